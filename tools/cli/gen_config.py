# Transitional: the command still lives in tools.repository.configs; its arguments and run() move here.
from tools.repository.configs import __doc__, add_arguments, run  # noqa: F401
