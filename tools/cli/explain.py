# Transitional: the command still lives in tools.observe.explain; its arguments and run() move here.
from tools.observe.explain import __doc__, add_arguments, run  # noqa: F401
