# Transitional: the command still lives in tools.observe.top; its arguments and run() move here.
from tools.observe.top import __doc__, add_arguments, run  # noqa: F401
