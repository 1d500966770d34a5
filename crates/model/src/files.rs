//! Reading the files a user names, bounded: a device, a pipe or a directory is an error naming
//! the path, never an endless or failed read.

use std::path::Path;

use crate::error::{ModelError, Result};

/// The bytes of the regular file `path`, at most `max` of them: a device (`/dev/zero`), a pipe
/// or a directory is an error naming the path, not an endless or failed read.
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(ModelError::Data { path: path.to_path_buf(), reason: "is not a regular file".into() });
    }
    if meta.len() > max {
        return Err(ModelError::Data {
            path: path.to_path_buf(),
            reason: format!("{} bytes is more than the {max} this reads", meta.len()),
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?, max + 1),
        &mut bytes,
    )
    .map_err(|e| ModelError::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(ModelError::Data { path: path.to_path_buf(), reason: format!("grew past the {max} bytes this reads") });
    }
    Ok(bytes)
}
