"""A drop folder's options: the optional `aoed.toml` in the inbox folder, read for each
model it takes, gives the job's spec (JobSpec.from_toml)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from aoe.errors import OptionError
from aoe.spec import JobSpec
from aoed import safefs

__all__ = ["OPTIONS_FILE", "folder_spec"]

#: the folder's options file (never a model)
OPTIONS_FILE = "aoed.toml"
#: bytes an options file may hold
_OPTIONS_MAX = 64 << 10


def folder_spec(folder: Path) -> JobSpec:
    """The job spec of `folder`'s aoed.toml (the defaults without one): JobSpec.from_toml.
    Raises OptionError naming the file and the key."""
    f = folder / OPTIONS_FILE
    try:
        # Opened as safefs opens files: a link or a FIFO planted under this name is neither
        # followed nor waited on.
        with os.fdopen(safefs.open_file(f), "rb") as fh:
            data = fh.read(_OPTIONS_MAX + 1)
        if len(data) > _OPTIONS_MAX:
            raise OptionError(
                f"{f}: larger than {_OPTIONS_MAX} bytes; an options file holds a few lines"
            )
        raw = tomllib.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raw = {}
    except safefs.LinkRefusedError as exc:
        raise OptionError(f"{f}: {exc.strerror}; the options file must be a regular file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"{f}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise OptionError(f"{f}: not valid TOML ({exc}); fix it and drop the model again") from None
    try:
        return JobSpec.from_toml(raw)
    except OptionError as exc:
        raise OptionError(f"{f}: {exc}; fix it and drop the model again") from None
