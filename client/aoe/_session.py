"""Old name of aoe.sessionopts, kept importable while work written against it lands; use aoe.sessionopts."""

import sys

from aoe import sessionopts

sys.modules[__name__] = sessionopts
