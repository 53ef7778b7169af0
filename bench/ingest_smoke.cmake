# ctest qstream_bench_ingest_smoke: bench/ingest_compare.py with one
# `qstream-bench load` client process against a qstreamd child (CPU backend,
# learner running at a small batch) must print a case with a positive rate
# and acked == ingested. A few seconds; the Reverb peer is not run here.
# cmake -DPYTHON=python3 -DSCRIPT=bench/ingest_compare.py -DBUILD=build -P ingest_smoke.cmake
# The daemon pinned to the first CPU this process may use (--daemon_cpus),
# which the case's daemon_affinity must then report.
execute_process(COMMAND ${PYTHON} -c "import os; print(min(os.sched_getaffinity(0)))"
  OUTPUT_VARIABLE cpu OUTPUT_STRIP_TRAILING_WHITESPACE)
execute_process(
  COMMAND ${PYTHON} ${SCRIPT} --build=${BUILD} --peers=cpp --items=64 --clients=1 --learner=running
          --learner_batch=32 --window_seconds=1 --repeats=1 --warmup_seconds=0.5 --idle_seconds=1
          --daemon_cpus=${cpu}
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 120)
message("${err}")
message("stdout: ${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ingest_compare.py exited with ${rc}")
endif()
string(REGEX MATCH "{\"bench\": \"ingest_compare\"[^\n]*" line "${out}")
string(JSON rate ERROR_VARIABLE json_error GET "${line}" transitions_per_s)
if(json_error OR NOT rate GREATER 0)
  message(FATAL_ERROR "transitions_per_s is '${rate}' (${json_error}), expected > 0")
endif()
string(JSON same GET "${line}" acked_eq_ingested)
if(NOT same)
  message(FATAL_ERROR "acked_eq_ingested is '${same}'")
endif()
string(JSON affinity GET "${line}" daemon_affinity)
if(NOT affinity STREQUAL "[ ${cpu} ]")
  message(FATAL_ERROR "daemon_affinity is '${affinity}', expected [ ${cpu} ] (--daemon_cpus=${cpu})")
endif()
