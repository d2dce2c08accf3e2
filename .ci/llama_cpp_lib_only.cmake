# Included after every project() of the llama-cpp-python build (.ci/run passes it as
# CMAKE_PROJECT_INCLUDE). llama-cpp-python's CMakeLists forces llama.cpp's "common" library on,
# but its Python code loads only libllama and libggml*: leaving common out skips 53 of the 127
# compiled files (its JSON-heavy sources and an HTTP client among them), the slower half of the build.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)
