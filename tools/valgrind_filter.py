"""Read a memcheck XML report; print and count the errors in mhattn's code.

An error is ours when a frame of its stack lies in the mhattn._C shared
object or in a source file of csrc/ (a file of that name in a folder csrc/
or below it: the glue's call.c and module.c share their names with
CPython's Objects/call.c and Python/module.c, which are not ours). The interpreter and NumPy report
plenty of their own (uninitialised reads in the allocator, memory kept
until exit); those are counted, not shown.

    python tools/valgrind_filter.py REPORT.xml SO_PATH
Exit status 1 when any error is ours.
"""
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
        for d, _, files in os.walk(os.path.join(ROOT, "csrc")) for f in files}


# The thread pool's workers live until the process exits (csrc/threads.c);
# glibc's thread-local storage and stacks for them are still held then, and
# memcheck calls them "possibly lost". They are allocated once per worker,
# not per call, so they are not leaks.
LIVE_THREAD_TLS = {"allocate_dtv", "allocate_dtv_entry", "_dl_allocate_tls"}


def live_thread_tls(err):
    return (err.findtext("kind") == "Leak_PossiblyLost"
            and any((f.findtext("fn") or "") in LIVE_THREAD_TLS
                    for f in err.findall("./stack/frame")))


def ours(frame, so_name):
    """The frame is in the extension, or in a source file of csrc/ by its
    path (the build's folder may be another checkout's, or pip's copy, so
    the path is read from its last csrc/ component on)."""
    obj = frame.findtext("obj") or ""
    if os.path.basename(obj) == so_name:
        return True
    path = "/".join(((frame.findtext("dir") or "").replace(os.sep, "/"),
                     frame.findtext("file") or ""))
    return "csrc/" in path and "csrc/" + path.rsplit("csrc/", 1)[1] in CSRC


def main(report, so_path):
    so_name = os.path.basename(so_path)
    total, mine = 0, []
    # The report can be tens of MB of the interpreter's noise: stream it.
    for _, elem in ET.iterparse(report):
        if elem.tag != "error":
            continue
        total += 1
        if (any(ours(f, so_name) for f in elem.findall("./stack/frame"))
                and not live_thread_tls(elem)):
            mine.append(elem)
        else:
            elem.clear()
    for err in mine:
        what = err.findtext("kind")
        text = err.findtext("what") or err.findtext("xwhat/text") or ""
        print(f"== {what}: {text}")
        for f in err.findall("./stack/frame")[:25]:
            where = f.findtext("file")
            line = f.findtext("line")
            loc = f"{where}:{line}" if where else os.path.basename(f.findtext("obj") or "?")
            print(f"     {f.findtext('fn') or '?'}  ({loc})")
    print(f"valgrind: {total} errors in all, {len(mine)} with mhattn's frames "
          f"({so_name}, csrc/)")
    return 1 if mine else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
