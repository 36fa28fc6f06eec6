"""Start-up measurements on a replica's own device: forward cost by width, exact widths, and the
dtype and GEMM to run in.

Costs differ by an order of magnitude between machines of the same size (DESIGN.md, "Speed"):
on an AMX CPU a 13-row bfloat16 forward of the target costs about one row's; on an AVX2-only
CPU, where bfloat16 is emulated, ten rows' worth, while float32 costs four. A CPU GEMM's cost
is not even monotonic in the rows (one 2-core AVX-512 machine: a float32 MLP projection took
5.3 ms for 13 rows and 3.6 ms for 16). So nothing here is assumed: a replica measures, for
each candidate (a dtype and a GEMM, candidates),

- ``forward_s[w - 1]``: the seconds of one forward over w positions extending a cache of
  CACHE_TOKENS positions, w = 1 .. max_width, and the prefill cost per prompt token;
- for the target, which widths give bitwise the same row results as each other
  (specdec.device.exact_widths.measure_exact_width_sets), the exact-width set whose forwards
  cover a lone request's 1 .. k_max + 1 rows and batches of up to max_batch_size sessions
  cheapest, and a whole-model check of it (measure);

and ``dtype: auto`` (or ``gemm: auto``) keeps the candidate whose predicted request time is
lowest (choice.predicted_request_seconds), among those with exact widths for the target and,
for a target, a prefill within PREFILL_MARGIN of the fastest candidate's (the time to first
token). The verifier pads each decode forward to the cheapest exact width that fits
(ExactWidths.width_for), the controller prices rounds from ``forward_s``, and GetModelInfo
reports all of it.

The modules, one job each: candidates (what is tried, in which order), results (what was
found), measure (one candidate's costs and exact widths), choice (which candidate wins),
casting (the loaded model in each candidate's dtype), host (one measurement at a time on a
host), load (the entry points: load_calibrated and calibrate). specdec.device.calibration_cache
keeps calibrations on disk.
"""
