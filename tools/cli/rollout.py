# Transitional: the command still lives in tools.ops.rollout; its arguments and run() move here.
from tools.ops.rollout import __doc__, add_arguments, run  # noqa: F401
