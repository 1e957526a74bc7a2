"""scripts/bench_decode_dispatch.py with every engine in the out-major layout (batch 1 too).

Run from the repository root with scripts/ on sys.path (dispatch_flags.sh sets PYTHONPATH).
"""

import sys

import bench_decode_dispatch

from a3po_jax.inference import engine_core

_init = engine_core.EngineCore.__init__


def _init_out_major(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.out_major = True


engine_core.EngineCore.__init__ = _init_out_major
bench_decode_dispatch.main(sys.argv[1:])
