"""How a stage's job runs: the job and its worker entry (jobs), where it runs (placement), starting
and streaming worker processes (launching), torch's CPU threads (cpu_threads), the libraries a
process hides (optional_libraries) and the library notes it drops (library_notes). Below every
stage package and the families; above only the contracts and cache/."""
