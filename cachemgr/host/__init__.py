"""The node's operating system, as the layers above use it: private cache files and
directories (`nodefiles`), threads at idle CPU and I/O priority (`background`), the trainer's
activity (`foreground`), the memory allocator's settings (`allocator`). Imports nothing of
cachemgr.
"""
