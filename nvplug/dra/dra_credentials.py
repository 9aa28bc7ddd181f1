"""Which credentials the DRA driver speaks to the API server with: nvplug.dra.kubeconfig resolved.

`kubelet` is the node's own identity, `system:node:<name>`: the kubelet's kubeconfig (for its server and
CA) with the client certificate the kubelet rotates. The Node authorizer and NodeRestriction then let it
write only its own node's ResourceSlices and read only the claims of pods bound to it, which is the least
a host service that reads those files anyway can hold. The certificate's file is loaded at each new
connection (ApiClient), so a rotation is picked up without a restart. `auto` is nvplug's own kubeconfig
where an operator put one, else the kubelet's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nvplug.config import DEFAULT_DRA_KUBECONFIG, KUBELET_KUBECONFIGS
from nvplug.config.model import DraConfig
from nvplug.dra.api_client import KubeConfig, KubeConfigError


def kubelet_kubeconfig(dra: DraConfig) -> Path | None:
    """The kubelet's kubeconfig: the configured one, or the first of the usual places that exists."""
    if dra.kubelet_kubeconfig is not None:
        return Path(dra.kubelet_kubeconfig)
    return next((Path(p) for p in KUBELET_KUBECONFIGS if Path(p).exists()), None)


def chosen(dra: DraConfig, own: Path = Path(DEFAULT_DRA_KUBECONFIG)) -> str:
    """`kubelet` or a kubeconfig's path, `auto` decided (`own`: where an operator puts nvplug's own)."""
    if dra.kubeconfig != "auto":
        return dra.kubeconfig
    kubelet = kubelet_kubeconfig(dra)
    if own.exists() or kubelet is None or not kubelet.exists():
        return str(own)
    return "kubelet"


def load_kubeconfig(dra: DraConfig) -> KubeConfig:
    """The credentials nvplug.dra.kubeconfig names. Raises KubeConfigError, naming the files it looked at."""
    choice = chosen(dra)
    if choice != "kubelet":
        return KubeConfig.load(Path(choice))
    path = kubelet_kubeconfig(dra)
    if path is None:
        raise KubeConfigError(
            f"nvplug.dra.kubeconfig is kubelet, but no kubelet kubeconfig is at {' or '.join(KUBELET_KUBECONFIGS)} "
            "(nvplug.dra.kubeletKubeconfig names another)"
        )
    config = KubeConfig.load(path)
    certificate = Path(dra.kubelet_certificate)
    if not certificate.exists():
        return config  # the kubeconfig's own user: a token, or a certificate elsewhere
    return replace(
        config,
        source=f"{path} with the client certificate {certificate}",
        cert_file=str(certificate),
        key_file=str(certificate),
        cert_data=None,
        key_data=None,
        token=None,
        token_file=None,
    )
