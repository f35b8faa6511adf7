"""The peer transport (--peers, docs/ARCHITECTURE.md "Peers"): how nodes talk to each other,
below every service that uses it. `proto` is the wire (routes, authentication, the order in
which peers are asked; no I/O), `client` asks peers for chunks and sends authenticated requests,
`server` answers them. It knows chunks and routes, never what another service's route means:
those are handed to the server by the engine (cachemgr.engine), and the import contract keeps
this package from importing the services above it.
"""
