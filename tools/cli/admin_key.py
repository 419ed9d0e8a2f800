# Transitional: the command still lives in tools.server.admin_key; its arguments and run() move here.
from tools.server.admin_key import __doc__, add_arguments, run  # noqa: F401
