"""Old name of aoe.lmdbenv, kept importable while work written against it lands; use aoe.lmdbenv."""

import sys

from aoe import lmdbenv

sys.modules[__name__] = lmdbenv
