"""Linux process memory probes shared by the benchmarks."""


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (VmHWM) through ``/proc/self/clear_refs``; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
