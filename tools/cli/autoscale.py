# Transitional: the command still lives in tools.planning.autoscale; its arguments and run() move here.
from tools.planning.autoscale import __doc__, add_arguments, run  # noqa: F401
