"""Shared by the benchmarks: sizes written as 4K, 32M, 1MiB."""


def parse_size(text: str) -> int:
    """'4K' -> 4096, '32M' -> 33554432, '1MiB' -> 1048576, '100' -> 100."""
    units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
