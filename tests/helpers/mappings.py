"""How many memory mappings this process holds: what the suite watches to free compiled
programs in time (conftest._free_compiled_programs)."""

# Every XLA:CPU executable keeps about three memory mappings (code, constants, data) for as
# long as a jit cache holds it. The whole suite in one process compiles thousands, and past
# the kernel's limit on mappings per process (`vm.max_map_count`, 65530 by default) the next
# compile crashes the interpreter inside XLA. One test file adds up to ~15 000.
MAX_MAPPINGS = 20_000


def mappings() -> int | None:
    """This process's memory mappings, or None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None
