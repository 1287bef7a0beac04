"""`shardforge webui`: the browser face, after its host and credentials are checked."""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from shardforge.commands.arg_types import at_least


def _cmd_webui(args: argparse.Namespace, console: Console) -> int:
    """The browser face: forms over the same config, the same `shardforge train` launched as a process."""
    from shardforge.extras import require
    from shardforge.webui.access import Root, require_auth

    require("webui", "shardforge webui")

    credentials, warning = require_auth(args.host, args.auth)  # before anything starts
    root = Root(args.root)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")
    from shardforge.webui.app import serve

    os.chdir(root.folder)  # the form's relative paths mean what they mean to the jobs it launches there
    console.print(f"web UI on http://{args.host}:{args.port}/ (files under {root.folder}; Ctrl-C stops)")
    serve(root, args.host, args.port, credentials)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge webui`: the flags, and the handler as `func`."""
    p_webui = sub.add_parser("webui", help="a web UI: configure, plan, launch, watch, chat and export")
    p_webui.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs --auth")
    p_webui.add_argument("--port", type=at_least(0), default=7860)
    p_webui.add_argument("--auth", default=None, help="USER:PASSWORD (or SHARDFORGE_WEBUI_AUTH)")
    p_webui.add_argument("--root", default=".", help="the only folder the UI reads and writes in")
    p_webui.set_defaults(func=_cmd_webui)
