# Transitional: the command still lives in tools.bench.sweep; its arguments and run() move here.
from tools.bench.sweep import __doc__, add_arguments, run  # noqa: F401
