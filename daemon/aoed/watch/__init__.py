"""The inbox agent: models dropped into watched folders are tuned once each, and their
outputs land in the folder's outbox (or the model in its failed folder, with the reason).

    inbox/m.onnx --settled--> claimed/<id>/.moved --copied--> claimed/<id>/m.onnx --submit--> job

    job --final-------------------> outbox/m_tuned.onnx
                                    outbox/m_result.json
                                    outbox/m_report.txt
        (failed, cancelled) ------> failed/m.onnx
                                    failed/m.onnx.error.txt

Its parts, one concept each:

    watcher.py    the agent (Watcher): watches each folder, tells when a dropped file is
                  complete, retries or fails a file that cannot be claimed
    discover.py   which entries are models to take, what the others are, and the signs
                  that a file is complete
    folders.py    drop folders made again, with the inbox's mode and group, when missing
    options.py    a folder's aoed.toml: the spec of the jobs of its models
    claims.py     exactly-once claims (Claims): claim, submit, settle after a crash
    _claimdir.py  a claim's folder on disk: the moved entry and the daemon's own copy
    delivery.py   finished jobs' outputs to the outbox, or the model to failed/ (Delivery)
    report.py     the report written beside the outputs

When a file is complete: names starting with `.` or ending in `.part` or `~` are
ignored, so a writer that copies to such a name and renames it is taken at once on the
rename. Any other `*.onnx`, `*.pt2` or `*.tar` directly in the folder is taken once
its size and mtime have stayed the same for the inbox's `stable_s`. A `.pt2` is a GDAT
job's (its folder's aoed.toml says job_type = "gdat"); its outbox gets
`m_ddp_config.json` where an ONNX model's gets `m_tuned.onnx`. A `*.tar` is a TensorFlow
SavedModel packed in one file (aoe.savedmodel): a directory is never taken, since it is
never complete at one moment nor claimed by one rename.

Exactly once: a file is claimed by renaming it into the state dir's `claimed/`, recorded
in the job store before the rename (`claiming`) and after its job is recorded
(`claimed`). At start, claims a crash interrupted are settled: renamed but not submitted
-> submitted; never renamed -> forgotten (the scan takes the file again); submitted ->
delivered when the job ends (or at once if it already has). A claim row is dropped only
after its delivery, so a crash during delivery delivers again (under a `_2` name) rather
than never.

What is hashed is what runs: whoever dropped the file may still hold it open for
writing, and a write through that descriptor reaches the renamed file wherever it is.
So the claim copies the moved file (`.moved`) to the daemon's own file (`m.onnx`, which
only the daemon can write) before anything reads it as a model, and the job (its hash,
its deduplication, what it tunes) uses only that copy (`_claimdir.privatize`). From another file
system the move is a copy already, straight to the daemon's own file.

Missing folders: an inbox, outbox or failed folder that is missing (at start, or removed
while the daemon runs) is made again with the inbox's `mode` and `group` (deploy/'s
2770: group-writable and setgid) and logged; one that cannot be made (a full disk, no
right to its parent) is logged naming it and why, and tried again every `remake_s`.

Options come from an optional `aoed.toml` in the inbox folder, read for each model:
precision, job_type (default sgat+opat, as `aoe tune`), input_shapes (a table name =
[dims], or a profile's "1~4,16~256" / [-1, -1]) and dynamic_dims (gears, "1,16;4,64"),
priority, budget_s, repeat_tune, min_cosine, max_rel_error; for GDAT world_size,
backend, gradient_precision. A dynamic model needs no shapes: the job derives them.
"""

from __future__ import annotations

from aoed.watch.options import OPTIONS_FILE, folder_spec
from aoed.watch.watcher import Watcher

__all__ = ["OPTIONS_FILE", "Watcher", "folder_spec"]
