# Transitional: the command still lives in tools.clients.tenant_token; its arguments and run() move here.
from tools.clients.tenant_token import __doc__, add_arguments, run  # noqa: F401
