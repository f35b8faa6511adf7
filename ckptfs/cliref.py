"""Shell completion and the man page, both generated from the `ckptfs` argparse parser
(`ckptfs.cli.build_parser`), so neither can drift from the options the CLI takes:
`ckptfs completion bash|zsh` prints a completion script, `ckptfs man` (and scripts/gen_man.py,
which writes docs/ckptfs.1) the man page. tests/unit/test_cli_conventions.py regenerates both and
checks that every option of every subcommand is in each, and that the checked-in page is what
the parser gives.

`walk` reads the parser into plain data (`Command`, `Opt`); the three renderers only format it.
Nothing here depends on who runs it (uid, environment, terminal width): the output is the same
on every machine, so the checked-in page can be compared byte for byte.

State: none; every function is pure over the parser it is given.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from . import config
from . import mount as _mount

SHELLS = ("bash", "zsh")


@dataclass(frozen=True)
class Opt:
    """One option (flags: its spellings, the primary first) or positional (flags: ())."""

    flags: tuple[str, ...]
    dest: str
    metavar: str | None  # None: a flag, no value
    choices: tuple[str, ...]
    help: str
    paths: bool          # its value is a path: complete file names
    group: str


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    description: str
    options: tuple[Opt, ...]
    positionals: tuple[Opt, ...]


def _opt(act: argparse.Action, group: str) -> Opt:
    takes = act.nargs != 0
    meta = act.metavar if isinstance(act.metavar, str) else (
        act.dest.upper() if act.option_strings else act.dest)
    return Opt(flags=tuple(act.option_strings), dest=act.dest, metavar=meta if takes else None,
               choices=tuple(str(c) for c in act.choices or ()), help=act.help or "",
               paths=act.type is Path, group=group)


def _actions(p: argparse.ArgumentParser) -> list[tuple[argparse.Action, str]]:
    """(action, its group's title) in the order --help lists them, without -h and hidden ones."""
    out = []
    for g in p._action_groups:
        title = g.title or ""
        for act in g._group_actions:
            if isinstance(act, (argparse._HelpAction, argparse._SubParsersAction)) or \
                    act.help == argparse.SUPPRESS:
                continue
            out.append((act, title))
    return out


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))


def walk(p: argparse.ArgumentParser) -> tuple[tuple[Opt, ...], tuple[Command, ...]]:
    """(the top-level options, the subcommands in the order they were added)."""
    sub = _subparsers(p)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    cmds = []
    for name, sp in sub.choices.items():
        acts = _actions(sp)
        cmds.append(Command(
            name=name, help=helps.get(name, ""), description=sp.description or "",
            options=tuple(_opt(a, t) for a, t in acts if a.option_strings),
            positionals=tuple(_opt(a, t) for a, t in acts if not a.option_strings)))
    top = tuple(_opt(a, t) for a, t in _actions(p) if a.option_strings)
    return top, tuple(cmds)


# ----------------------------------------------------------------------------------------------
# bash


def _words(xs: list[str]) -> str:
    return " ".join(xs)


def _bash_command(c: Command) -> str:
    """The `case` branch of one subcommand: values of the previous option, then options, then
    positionals."""
    lines = [f"        {c.name})"]
    valued = [o for o in c.options if o.metavar is not None]
    cases = []
    for o in valued:
        pat = "|".join(o.flags)
        if o.choices:
            ws = _words(list(o.choices))
            cases.append(f'                {pat}) COMPREPLY=($(compgen -W "{ws}" -- "$cur"));'
                         ' return 0 ;;')
        elif o.paths:
            cases.append(f"                {pat}) _ckptfs_files; return 0 ;;")
        else:
            cases.append(f"                {pat}) return 0 ;;")
    if cases:
        lines += ['            case "$prev" in', *cases, "            esac"]
    flags = [f for o in c.options for f in o.flags] + ["--help"]
    lines.append(f'            opts="{_words(flags)}"')
    choices = [ch for p in c.positionals for ch in p.choices]
    lines.append(f'            words="{_words(choices)}"')
    lines.append("            ;;")
    return "\n".join(lines)


def bash(p: argparse.ArgumentParser) -> str:
    top, cmds = walk(p)
    names = [c.name for c in cmds]
    top_flags = [f for o in top for f in o.flags] + ["--help"]
    branches = "\n".join(_bash_command(c) for c in cmds)
    return f"""# bash completion for ckptfs; generated from its parser by `ckptfs completion bash`.
# Install: ckptfs completion bash > /etc/bash_completion.d/ckptfs (or source it in ~/.bashrc).

_ckptfs_files() {{
    compopt -o filenames 2>/dev/null
    COMPREPLY=($(compgen -f -- "$cur"))
}}

_ckptfs() {{
    local cur prev cmd opts words i
    COMPREPLY=()
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev=""
    (( COMP_CWORD > 0 )) && prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    # --opt=value: bash splits at '=' (COMP_WORDBREAKS)
    if [[ $cur == "=" ]]; then
        cur=""
    elif [[ $prev == "=" ]] && (( COMP_CWORD > 1 )); then
        prev="${{COMP_WORDS[COMP_CWORD-2]}}"
    fi
    cmd=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            -*) ;;
            *) cmd="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    if [[ -z $cmd ]]; then
        if [[ $cur == -* ]]; then
            COMPREPLY=($(compgen -W "{_words(top_flags)}" -- "$cur"))
        else
            COMPREPLY=($(compgen -W "{_words(names)}" -- "$cur"))
        fi
        return 0
    fi
    opts=""
    words=""
    case "$cmd" in
{branches}
        *) return 0 ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif [[ -n $words ]]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    else
        _ckptfs_files
    fi
    return 0
}}

complete -F _ckptfs ckptfs
"""


# ----------------------------------------------------------------------------------------------
# zsh


def _zsh_text(s: str) -> str:
    """A help text as a zsh _arguments description: its first clause, no brackets or quotes."""
    first = re.split(r";| \(", s, maxsplit=1)[0].strip().rstrip(".:,")
    return re.sub(r"[\[\]':\\]", "", first)


def _zsh_spec(o: Opt) -> str:
    desc = _zsh_text(o.help)
    if o.metavar is None:
        value = ""
    elif o.choices:
        value = f":{_zsh_text(o.metavar)}:({' '.join(o.choices)})"
    else:
        value = f":{_zsh_text(o.metavar)}:{'_files' if o.paths else ' '}"
    if len(o.flags) == 1:
        return f"'{o.flags[0]}[{desc}]{value}'"
    excl = " ".join(o.flags)
    return f"'({excl})'{{{','.join(o.flags)}}}'[{desc}]{value}'"


def zsh(p: argparse.ArgumentParser) -> str:
    top, cmds = walk(p)
    values = " \\\n        ".join(f"'{c.name}[{_zsh_text(c.help)}]'" for c in cmds)
    branches = []
    for c in cmds:
        specs = [_zsh_spec(o) for o in c.options]
        for i, pos in enumerate(c.positionals, 1):
            action = f"({' '.join(pos.choices)})" if pos.choices else "_files"
            specs.append(f"'{i}:{pos.metavar or pos.dest}:{action}'")
        body = " \\\n                ".join(specs)
        branches.append(f"            {c.name})\n                _arguments {body} ;;")
    top_specs = " ".join(_zsh_spec(o) for o in top)
    return f"""#compdef ckptfs
# zsh completion for ckptfs; generated from its parser by `ckptfs completion zsh`.
# Install: ckptfs completion zsh > "${{fpath[1]}}/_ckptfs" (then restart zsh).

_ckptfs() {{
    local line state
    _arguments -C {top_specs} '1: :->cmds' '*::arg:->args'
    case $state in
        cmds)
            _values 'ckptfs command' \\
        {values} ;;
        args)
            case $line[1] in
{chr(10).join(branches)}
            esac ;;
    esac
}}

_ckptfs "$@"
"""


# ----------------------------------------------------------------------------------------------
# the man page


def _roff(s: str) -> str:
    """Text for a roff body line: backslashes and hyphens escaped, no line starting a request."""
    s = s.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + ln if ln[:1] in (".", "'") else ln for ln in s.splitlines())


def _flag_line(o: Opt) -> str:
    meta = f" \\fI{_roff(o.metavar)}\\fR" if o.metavar else ""
    if o.choices:
        meta = " {" + ",".join(_roff(c) for c in o.choices) + "}"
    return ", ".join(f"\\fB{_roff(f)}\\fR{meta}" for f in o.flags)


def _man_command(c: Command) -> list[str]:
    pos = " ".join(_roff(p.metavar or p.dest).upper() for p in c.positionals)
    out = [f'.SS "ckptfs {c.name} [options]{" " + pos if pos else ""}"',
           _roff(c.description or c.help)]
    group = None
    for o in (*c.positionals, *c.options):
        if o.group != group and o.group not in ("positional arguments", "options"):
            out += [".PP", f"\\fI{_roff(o.group)}\\fR:"]
        group = o.group
        head = f"\\fI{_roff((o.metavar or o.dest).upper())}\\fR" if not o.flags else _flag_line(o)
        out += [".TP", head, _roff(o.help)]
    return out


def _environment() -> list[str]:
    env = [
        (", ".join(config.ENDPOINT_ENV), ("the S3 endpoint when --endpoint-url is not given "
         f"(the first set wins; {config.IGNORE_ENDPOINTS_ENV}=true ignores them, as boto3 "
         "does)")),
        (", ".join(config.REGION_ENV), ("the S3 region when --region is not given (the first "
         "set wins)")),
        ("AWS_PROFILE", "the AWS profile when --profile is not given (read by boto3)"),
        (("AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_CONFIG_FILE, "
         "AWS_SHARED_CREDENTIALS_FILE"), ("the AWS credential chain (ckptfs takes no keys as "
         "options)")),
        ("CKPTFS_LOG_AWS_DEBUG", ("1: botocore, boto3, urllib3 and s3transfer log at debug "
         "level with --log-level debug (credential values are masked either way)")),
        ("XDG_CACHE_HOME, XDG_DATA_HOME, XDG_RUNTIME_DIR", ("where a non-root user's default "
         "cache dir, default store and registrations live")),
    ]
    out = [".SH ENVIRONMENT", ("Precedence: an option, then the environment, then the AWS "
           "config files.")]
    for names, what in env:
        out += [".TP", f"\\fB{_roff(names)}\\fR", _roff(what)]
    return out


def _exit_status() -> list[str]:
    codes = sorted((v, k[len("EXIT_"):].lower().replace("_", " ")) for k, v in
                   vars(_mount).items() if k.startswith("EXIT_") and isinstance(v, int))
    out = [".SH EXIT STATUS", ("Every failure prints one line, \\fBckptfs: \\fIreason\\fR, on "
           "standard error. README.md \\(lqExit codes\\(rq has each code's cases.")]
    for v, name in codes:
        out += [".TP", f"\\fB{v}\\fR", _roff(name)]
    return out


def man(p: argparse.ArgumentParser) -> str:
    top, cmds = walk(p)
    out = ['.TH CKPTFS 1 "" "ckptfs" "User Commands"',
           ".\\\" generated from the ckptfs parser by scripts/gen_man.py: do not edit",
           ".SH NAME", "ckptfs \\- " + _roff(p.description or ""),
           ".SH SYNOPSIS", ("\\fBckptfs\\fR [\\fB\\-\\-version\\fR] \\fIcommand\\fR "
           "[\\fIoptions\\fR] [\\fIarguments\\fR]"),
           ".SH DESCRIPTION",
           ("ckptfs mounts a local write\\-back cache over an object store (S3 or a directory) "
           "for training checkpoints. The commands:")]
    for c in cmds:
        out += [".TP", f"\\fB{c.name}\\fR", _roff(c.help)]
    out.append(".SH OPTIONS")
    for o in top:
        out += [".TP", _flag_line(o), _roff(o.help)]
    out.append(".SH COMMANDS")
    for c in cmds:
        out += _man_command(c)
    out += [".SH FSTAB", _roff(
        "mount.fuse.ckptfs, the mount(8) helper, takes every `ckptfs mount` option as "
        "-o NAME[=VALUE], NAME being the option without its leading -- and with - written _ "
        "(endpoint_url=URL, allow_other, uid=N); ro is --read-only.")]
    out += _environment()
    out += _exit_status()
    out += [".SH SEE ALSO", ("\\fBmount\\fR(8), \\fBfusermount3\\fR(1), \\fBfuse\\fR(8); "
            "README.md and docs/ in the ckptfs repository.")]
    return "\n".join(out) + "\n"


def render(what: str, p: argparse.ArgumentParser) -> str:
    """`ckptfs completion bash|zsh` and `ckptfs man`."""
    return {"bash": bash, "zsh": zsh, "man": man}[what](p)
