"""The tritonserver process: finding the distribution in the `nvidia-pytriton` wheel, starting and
stopping the server (`triton_server`), its Python backend stub processes (`stubs`), its model
repository and health endpoints (`control`), bringing crashed Python-backend instances back
(`supervisor`), and the admin key that guards its control endpoints (`admin_key`)."""
