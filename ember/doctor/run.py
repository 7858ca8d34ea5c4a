"""``ember doctor script.py``: a training script run under the doctor."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from types import TracebackType

from ember.doctor.doctor import Doctor, DoctorDone


def run_script(script: str, arguments: list[str], *, steps: int, as_json: bool, module: bool = False) -> int:
    """Run a training script (as ``python script.py`` would) under the doctor; return its exit status."""
    import runpy

    from ember.launch import close_process_group

    os.environ["EMBER_DOCTOR"] = json.dumps({"steps": steps, "json": as_json})  # for a relaunch into workers
    doctor = Doctor(steps=steps, stop=True, as_json=as_json).install()
    sys.argv = [script, *arguments]
    status = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except DoctorDone:
        pass
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except Exception as error:  # the script's own error: its traceback as `python script.py` shows it
        traceback.print_exception(type(error), error, _script_frames(error.__traceback__))
        close_process_group()
        return 1
    with contextlib.suppress(DoctorDone):
        doctor.finish()  # the script ended before the doctor had seen all its steps
    close_process_group()  # a plain script may leave its group open; its threads must end before exit
    return status


def _script_frames(frames: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on, without run_script's and runpy's frames before it."""
    import runpy

    ours = (__file__, runpy.__file__, "<frozen runpy>")  # runpy is frozen into the interpreter since 3.11
    while frames is not None and frames.tb_frame.f_code.co_filename in ours:
        frames = frames.tb_next
    return frames
