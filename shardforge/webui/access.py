"""Who may use the web UI and what it may touch: loopback by default, a password beyond it, and every
path the UI reads or writes kept inside one root folder."""

from __future__ import annotations

import os
from pathlib import Path

from shardforge.config.paths import file_refs
from shardforge.config.schema import Config
from shardforge.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
AUTH_ENV = "SHARDFORGE_WEBUI_AUTH"  # user:password, when not given as --auth


def parse_auth(text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigError(f"--auth / {AUTH_ENV}: expected USER:PASSWORD, got {text!r}")
    return user, password


def require_auth(host: str, auth: str | None) -> tuple[tuple[str, str] | None, str | None]:
    """(credentials, a warning to print): beyond loopback the UI launches jobs and reads files on the
    user's behalf, so it needs a password; given by --auth or the environment."""
    credentials = parse_auth(auth or os.environ.get(AUTH_ENV))
    if host in LOOPBACK:
        return credentials, None
    if credentials is None:
        raise ConfigError(
            f"--host {host} serves the UI beyond this machine: give --auth USER:PASSWORD (or set {AUTH_ENV})"
        )
    return (
        credentials,
        f"the web UI listens on {host}: anyone who can reach it and has the password can run jobs",
    )


class Root:
    """The folder the UI may read and write in; relative paths are taken from it (it is the working
    directory of the jobs it launches)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ConfigError(f"--root {folder}: no such folder")

    def resolve(self, path: str | Path, what: str = "path") -> Path:
        """`path` inside the root (relative paths are relative to it); anything outside is refused."""
        full = (self.folder / Path(path).expanduser()).resolve()
        if full != self.folder and self.folder not in full.parents:
            raise ConfigError(f"{what} {str(path)!r} is outside the web UI's root {self.folder} (see --root)")
        return full

    def check_config(self, config: Config) -> None:
        """Every path the config names (by its keys' types) inside the root, and for a model, what loading
        it reads besides (an adapter's base model, a checkpoint's model)."""
        for key, path, ref in file_refs(config):
            full = self.resolve(path, key)
            if ref.model:
                self.check_model(full, key)

    def check_model(self, folder: Path, what: str) -> Path:
        """`folder` (inside the root) and every folder loading it reads, inside the root; returns it."""
        from shardforge.infer.load import sources_read

        for other in sources_read(folder):
            self.resolve(self.folder / other, f"{what} (it reads {other})")
        return folder
