# Transitional: the command still lives in tools.bench.profiler; its arguments and run() move here.
from tools.bench.profiler import __doc__, add_arguments, run  # noqa: F401
