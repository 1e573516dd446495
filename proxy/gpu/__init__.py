"""GPU memory readings: what the proxy knows of the devices, never what it decides from them.

Owns: the NVML, file and no-GPU readers (`readers`), which processes on this host are one engine (`processes`), and
how much memory an engine takes awake (`footprint`, the one owner of that number).
May import: nothing of the proxy.
Door: readers, footprint.
"""
