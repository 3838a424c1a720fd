# cmake -P script of the zopt.install test (test/install/CMakeLists.txt).
cmake_minimum_required(VERSION 3.20)

function(run)
  cmake_parse_arguments(R "" "WORKING_DIRECTORY;OUTPUT" "COMMAND;ENV" ${ARGN})
  string(JOIN " " _cmd ${R_COMMAND})
  message(STATUS "$ ${_cmd}")
  if(R_ENV)
    set(_full ${CMAKE_COMMAND} -E env ${R_ENV} ${R_COMMAND})
  else()
    set(_full ${R_COMMAND})
  endif()
  if(NOT R_WORKING_DIRECTORY)
    set(R_WORKING_DIRECTORY ${WORK})
  endif()
  execute_process(COMMAND ${_full} WORKING_DIRECTORY ${R_WORKING_DIRECTORY}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(out)
    message("${out}")
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${_cmd}\n${err}")
  endif()
  if(err)
    message("${err}")
  endif()
  if(R_OUTPUT)
    set(${R_OUTPUT} "${out}" PARENT_SCOPE)
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
set(P ${WORK}/prefix)

# 1. Install.
run(COMMAND ${CMAKE_COMMAND} --install ${ZOPT_BUILD_DIR} --prefix ${P})
set(expect
  bin/zopt-compile bin/zopt-opt bin/zopt-run bin/zopt-import-deepspeed
  lib/libzopt_runtime.so
  include/zopt/zopt.h include/zopt/abi.h include/zopt/comm.h include/zopt/cpu.h
  lib/cmake/zopt/zoptConfig.cmake lib/cmake/zopt/zoptConfigVersion.cmake
  lib/cmake/zopt/zoptTargets.cmake
  ${PYTHONDIR}/zopt/__init__.py ${PYTHONDIR}/zopt/deepspeed.py)
if(EXISTS ${ZOPT_BUILD_DIR}/lib/libzopt_comm_mpi.so)
  list(APPEND expect lib/libzopt_comm_mpi.so)
endif()
foreach(f ${expect})
  if(NOT EXISTS ${P}/${f})
    message(FATAL_ERROR "cmake --install did not install ${f}")
  endif()
endforeach()
message(STATUS "installed: ${expect}")

# 2. The installed tools: DeepSpeed config -> description -> step.so -> run.
#    (--device cpu: an f32 AdamW step under ZeRO-1 that runs on this CPU.)
run(COMMAND ${P}/bin/zopt-import-deepspeed
        ${ZOPT_SOURCE_DIR}/python/tests/data/deepspeed/zero1_adam.json
        --device cpu -o ${WORK}/step.mlir --defaults ${WORK}/defaults.json
    ENV ZOPT_PYTHON=${PYTHON})
run(COMMAND ${P}/bin/zopt-compile ${WORK}/step.mlir -o ${WORK}/step.so)
run(COMMAND ${P}/bin/zopt-run ${WORK}/step.so --params 4096 --steps 2)

# 3. An outside project: find_package(zopt) -> zopt::runtime.
run(COMMAND ${CMAKE_COMMAND} -S ${ZOPT_SOURCE_DIR}/test/install/consumer
        -B ${WORK}/consumer -G ${GENERATOR} -DCMAKE_C_COMPILER=${C_COMPILER}
        -DCMAKE_PREFIX_PATH=${P} -DCMAKE_BUILD_TYPE=Release
    OUTPUT cfg)
if(NOT cfg MATCHES "zopt-compile: ${P}/bin/zopt-compile")
  message(FATAL_ERROR "the zopt package did not report its zopt-compile")
endif()
run(COMMAND ${CMAKE_COMMAND} --build ${WORK}/consumer)
run(COMMAND ${WORK}/consumer/zopt_consumer ${WORK}/step.so)

# 4. The Python package, from the install, finding the installed runtime.
set(clean --unset=ZOPT_RUNTIME_LIB --unset=ZOPT_COMPILE --unset=ZOPT_PREFIX
          --unset=PYTHONPATH)
#  a. the copy cmake --install made: found through the package's location.
run(COMMAND ${PYTHON} ${ZOPT_SOURCE_DIR}/test/install/check_python.py ${P} package
    ENV ${clean} PYTHONPATH=${P}/${PYTHONDIR} ZOPT_CACHE_DIR=${WORK}/cache-a)
#  b. pip install ./python (offline: no build isolation, no dependencies), into
#     a target directory away from the prefix: found through ZOPT_PREFIX, then
#     through zopt-compile on the PATH.
execute_process(COMMAND ${PYTHON} -m pip --version RESULT_VARIABLE no_pip
                OUTPUT_QUIET ERROR_QUIET)
if(no_pip EQUAL 0)
  # A copy of python/: setuptools writes build/ and *.egg-info next to the
  # sources, which must not land in the source tree.
  file(COPY ${ZOPT_SOURCE_DIR}/python/ DESTINATION ${WORK}/pysrc
       PATTERN "__pycache__" EXCLUDE PATTERN "tests" EXCLUDE)
  run(COMMAND ${PYTHON} -m pip install --no-build-isolation --no-deps --no-index
          --no-cache-dir --disable-pip-version-check --target ${WORK}/site ${WORK}/pysrc
      ENV ${clean})
  run(COMMAND ${PYTHON} ${ZOPT_SOURCE_DIR}/test/install/check_python.py ${P} ZOPT_PREFIX
      ENV ${clean} PYTHONPATH=${WORK}/site ZOPT_PREFIX=${P}
          ZOPT_CACHE_DIR=${WORK}/cache-b)
  run(COMMAND ${PYTHON} ${ZOPT_SOURCE_DIR}/test/install/check_python.py ${P} PATH
      ENV ${clean} PYTHONPATH=${WORK}/site "PATH=${P}/bin:$ENV{PATH}"
          ZOPT_CACHE_DIR=${WORK}/cache-c)
else()
  message(STATUS "no pip for ${PYTHON}: pip install ./python not tested")
endif()
message(STATUS "zopt.install: ok")
