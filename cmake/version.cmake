# Writes ${OUT} (qstream/version.h) with the current git commit. Runs on every
# build; configure_file rewrites the header only when the commit changed, so
# only the few files that include it recompile.
execute_process(COMMAND git rev-parse --short HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE QSTREAM_GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT QSTREAM_GIT_COMMIT)
  set(QSTREAM_GIT_COMMIT "unknown")
endif()
configure_file(${SRC}/cmake/version.h.in ${OUT} @ONLY)
