# Transitional: the command still lives in tools.planning.capacity; its arguments and run() move here.
from tools.planning.capacity import __doc__, add_arguments, run  # noqa: F401
