// Whole-file replacement that a crash cannot leave half done, for small
// files that other processes (or a restarted keeld) read whole.
#pragma once

#include "common/error.h"

#include <sys/types.h>

#include <filesystem>
#include <string_view>

namespace keel::common {

// Makes `path` hold exactly `bytes`: readers see the old file or the whole
// new one, never a part. A temporary beside it is created with O_EXCL and
// `mode` (so a secret is never readable by others, not even for a moment;
// the umask can only narrow it), written, fsynced and renamed over `path`,
// then the directory is fsynced. Error(`code`) naming the file and the step
// that failed; the temporary is removed then.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes, mode_t mode, ErrorCode code);

}  // namespace keel::common
