import pytest

from tierwise.offload.core.errors import SizeError
from tierwise.offload.core.units import format_size
from tierwise.offload.core.sizes import parse_size


@pytest.mark.parametrize("text,expected", [
    ("24G", 24 << 30), ("24GiB", 24 << 30), ("24gib", 24 << 30), ("512M", 512 << 20),
    ("1.5T", int(1.5 * (1 << 40))), ("4096B", 4096), ("64KiB", 64 << 10), ("2GB", 2 * 10**9),
    (" 8 G ", 8 << 30), (123, 123), (None, None),
], ids=str)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "24X", "-1G", "1e9", "24 G B", "twelve"])
def test_parse_size_rejects_with_clear_message(text):
    """(A number without a unit: its own message, test_a_number_without_a_unit_is_refused.)"""
    with pytest.raises(SizeError, match=r"bad --gpu-mem .*24G \(24 GiB\), 512M or 1.5T; 24GB is 24 x 10\^9 bytes"):
        parse_size(text, what="--gpu-mem")


def test_format_size():
    assert format_size(24 << 30) == "24.00 GiB"
    assert format_size(100) == "100 B"


@pytest.mark.parametrize("text", ["48", "4096", " 1.5 "])
def test_a_number_without_a_unit_is_refused(text):
    """The Trainer's offload={"gpu_mem": "48"} was 48 bytes, refused only once training began."""
    with pytest.raises(SizeError, match=rf"gpu_mem {text.strip()} has no unit: write {text.strip()}G for GiB"):
        parse_size(text, what="gpu_mem")
    with pytest.raises(SizeError, match="must be positive"):
        parse_size("0", what="gpu_mem")
