"""The gateway's HTTP API, one ``APIRouter`` a module, included by ``app.create_app``:
``completions`` (``/v1/chat/completions``, ``/v1/completions``), ``responses``
(``/v1/responses``), ``batches`` (``/v1/files``, ``/v1/batches``), ``models`` (``/v1/models``),
``admin`` (``/health``, ``/ready``, ``/metrics``) and ``adapters``
(``/admin/pools/{pool}/adapters``, admin keys only). What they share comes in through
``deps.py``."""
