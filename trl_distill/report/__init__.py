"""`trl-distill report OUTPUT_DIR`: a run's curves as one PNG (`curves`) and a short Markdown summary (`summary`),
read from its `trainer_state.json` and the run record beside it or in its checkpoints (`history`)."""

from .history import RunHistory, load_history, write_run_record
from .write import write_report

__all__ = ["RunHistory", "load_history", "write_report", "write_run_record"]
