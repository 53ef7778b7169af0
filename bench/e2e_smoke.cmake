# ctest qstream_bench_e2e_smoke: `qstream-bench e2e` on the CPU backend must
# print one JSON line with a positive learner rate, ingest rate and reference.
# cmake -DBENCH=path/qstream-bench -DQSTREAMD=path/qstreamd -P e2e_smoke.cmake
execute_process(
  COMMAND ${BENCH} e2e --qstreamd=${QSTREAMD} --backend=cpu --config=small --batch=32 --seconds=2
          --streams=2 --items_per_message=64 --reference=on
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
message("${err}")
message("stdout: ${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "qstream-bench e2e exited with ${rc}")
endif()
string(STRIP "${out}" line)
foreach(field learner_steps_per_s ingest_transitions_per_s acked_transitions_per_s step_p50_us step_rate_ratio)
  string(JSON value ERROR_VARIABLE json_error GET "${line}" ${field})
  if(json_error OR NOT value GREATER 0)
    message(FATAL_ERROR "${field} is '${value}' (${json_error}), expected > 0")
  endif()
endforeach()
string(JSON bench GET "${line}" bench)
string(JSON exit_status GET "${line}" daemon_exit_status)
if(NOT bench STREQUAL "e2e" OR NOT exit_status EQUAL 0)
  message(FATAL_ERROR "bench '${bench}', daemon_exit_status '${exit_status}'")
endif()
