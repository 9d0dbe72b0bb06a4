"""The devices fleetd computes on, by the names `-d/--device` and the nodes file's `devices=`
take: checked where they are written, not only when a daemon starts."""

DEVICE_NAMES = ("cpu", "numpy")  # cpu: ggml's CPU kernels; numpy: the portable op table


def unknown_devices(names) -> list[str]:
    """The names in `names` fleetd has no device for (case and spaces as make_device reads them)."""
    return [n for n in names if n.strip().lower() not in DEVICE_NAMES]
