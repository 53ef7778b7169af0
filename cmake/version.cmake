# Writes ${OUT} (qstream/version.h) with the current git commit. Runs on every
# build; configure_file rewrites the header only when the commit changed, so
# only the few files that include it recompile.
# Without a .git (a container build context excludes it) the environment's
# QSTREAM_GIT_COMMIT says which commit this is (docker build --build-arg).
if(DEFINED ENV{QSTREAM_GIT_COMMIT} AND NOT "$ENV{QSTREAM_GIT_COMMIT}" STREQUAL "")
  set(QSTREAM_GIT_COMMIT "$ENV{QSTREAM_GIT_COMMIT}")
else()
  execute_process(COMMAND git rev-parse --short HEAD WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE QSTREAM_GIT_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
if(NOT QSTREAM_GIT_COMMIT)
  set(QSTREAM_GIT_COMMIT "unknown")
endif()
configure_file(${SRC}/cmake/version.h.in ${OUT} @ONLY)
