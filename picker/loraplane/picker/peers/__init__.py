"""Today's peers on loraplane's picker: their plugins (``loraplane.picker.peers.plugins``) and their packaged
``EndpointPickerConfig``s (``<name>.yaml`` here, loaded with ``--config peer:<name>`` or
``EndpointPickerConfig.load("peer:<name>")``)."""

from importlib import resources

from loraplane.picker.peers import dynamo, latency, plugins  # noqa: F401  (registers the peer plugin types)

#: ``--config peer:<name>`` loads ``<name>.yaml`` of this package
PEER_PREFIX = "peer:"


def peer_configs() -> list[str]:
    """The packaged peer configs' names."""
    return sorted(entry.name.removesuffix(".yaml") for entry in resources.files(__name__).iterdir()
                  if entry.name.endswith(".yaml"))


def peer_config_text(name: str) -> str:
    """The YAML of the packaged peer config ``name`` (ValueError naming the known ones)."""
    if name not in peer_configs():
        raise ValueError(f"no packaged peer config {name!r}; known: {', '.join(peer_configs())}")
    return resources.files(__name__).joinpath(f"{name}.yaml").read_text()
