"""``python -m openinfer.engine_core``: the engine-core process (see ``process``)."""

import sys

from openinfer.engine_core.startup import early_cuda_from_argv

# before the process's imports (ZMQ, protobuf, the engine): OPENINFER_EARLY_CUDA=1 overlaps them
# with CuPy's import and the CUDA context
early_cuda_from_argv(sys.argv[1:])

from openinfer.engine_core.process import main  # noqa: E402

sys.exit(main())
