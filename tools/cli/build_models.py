# Transitional: the command still lives in tools.repository.build; its arguments and run() move here.
from tools.repository.build import __doc__, add_arguments, run  # noqa: F401
