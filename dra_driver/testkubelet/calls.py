"""What a kubelet call carries that needs no gRPC: the API versions, the kubelet's timeouts and
claim references (so the CLI can declare its options without loading gRPC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

KUBELET_CALL_TIMEOUT: Final = 45.0
"""The kubelet's timeout for DRA calls, in seconds."""
REGISTRATION_TIMEOUT: Final = 10.0
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
DRA_PLUGIN_TYPE: Final = "DRAPlugin"
KUBELET_KNOWN_VERSIONS: Final = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""The DRAPlugin service versions this client (like kubelet 1.34+) can speak."""
APIS: Final = ("v1", "v1beta1")


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends about a ResourceClaim: namespace, name and UID."""

    namespace: str
    name: str
    uid: str

    @classmethod
    def parse(cls, text: str) -> ClaimRef:
        """Parse ``NAMESPACE/NAME/UID``; ValueError naming the text otherwise."""
        parts = text.split("/")
        if len(parts) != 3 or not all(p.strip() for p in parts):
            raise ValueError(
                f"claim {text!r} is not NAMESPACE/NAME/UID "
                "(three non-empty parts separated by '/', e.g. default/my-claim/0b6c...)"
            )
        namespace, name, uid = (p.strip() for p in parts)
        return cls(namespace=namespace, name=name, uid=uid)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"
