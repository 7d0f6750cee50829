"""Which ``CONVSERVE_*`` environment variables are settings: the rest of our own names, and the service links
Kubernetes adds to a pod's environment, are not, and any other is a misspelt setting."""

from __future__ import annotations

import re
from typing import Iterable, Mapping

#: CONVSERVE_ variables that are not settings: the config file's path, and the clients' server URL
NOT_SETTINGS = frozenset({"CONVSERVE_CONFIG", "CONVSERVE_URL"})
# What Kubernetes puts in every pod's environment for a Service named convserve (or convserve-<x>) in its
# namespace (docker/k8s has one), unless the pod spec says enableServiceLinks: false: CONVSERVE[_<X>]_SERVICE_HOST,
# CONVSERVE[_<X>]_SERVICE_PORT[_<NAME>], CONVSERVE[_<X>]_PORT=tcp://<ip>:<port> and
# CONVSERVE[_<X>]_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]. None is a setting.
_SERVICE_LINK = re.compile(r"CONVSERVE(_[A-Z0-9_]+?)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|"
                           r"PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")
_SERVICE_LINK_URL = re.compile(r"(tcp|udp|sctp)://", re.I)


def is_service_link(name: str, value: str) -> bool:
    """Is environment variable ``name=value`` one of Kubernetes' service links for a Service named convserve or
    convserve-<x> (ignored: a pod may get them from any such Service in its namespace)? ``CONVSERVE_PORT`` is one
    only when its value is a URL (``tcp://10.0.0.1:8000``); as a number it is the port setting."""
    if name.endswith("_PORT") and _SERVICE_LINK_URL.match(value):      # CONVSERVE[_<X>]_PORT=tcp://...
        return True
    return bool(_SERVICE_LINK.fullmatch(name))


def unknown_variables(environ: Mapping[str, str], settings: Iterable[str]) -> list:
    """The ``CONVSERVE_*`` variables of ``environ`` that name none of ``settings`` (field names), sorted."""
    fields = set(settings)
    return sorted(k for k, v in environ.items() if k.startswith("CONVSERVE_") and k not in NOT_SETTINGS
                  and k[len("CONVSERVE_"):].lower() not in fields and not is_service_link(k, v))
