# Transitional: the command still lives in tools.bench.goodput; its arguments and run() move here.
from tools.bench.goodput import __doc__, add_arguments, run  # noqa: F401
