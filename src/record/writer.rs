//! The writer thread: takes exchanges off the queue, writes them as JSON lines, and rotates the
//! file by size (`path` → `path.1` → … → `path.<max_files-1>`, the oldest deleted). Blocking file
//! I/O lives here, never on a request's task.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;

use prometheus::{IntCounter, IntCounterVec};

use super::Message;
use super::config::RecordConfig;
use crate::metrics::labels::RecordDrop;

/// An append-only JSONL file with size-based rotation.
pub struct RotatingFile {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
    file: Option<BufWriter<File>>,
    size: u64,
}

impl RotatingFile {
    pub fn new(path: impl Into<PathBuf>, max_bytes: u64, max_files: u32) -> Self {
        RotatingFile {
            path: path.into(),
            max_bytes,
            max_files: max_files.max(1),
            file: None,
            size: 0,
        }
    }

    /// Writes one line, rotating first when it would take the file past `max_bytes` (a line
    /// larger than `max_bytes` gets a file of its own).
    pub fn write_line(&mut self, line: &[u8]) -> std::io::Result<()> {
        if self.file.is_none() {
            self.open()?;
        }
        if self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
            self.rotate()?;
        }
        let Some(file) = self.file.as_mut() else {
            return Err(std::io::Error::other("the record file is not open"));
        };
        if let Err(e) = file.write_all(line) {
            self.file = None; // reopened (and its size re-read) on the next line
            return Err(e);
        }
        self.size += line.len() as u64;
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match self.file.as_mut() {
            Some(file) => file.flush(),
            None => Ok(()),
        }
    }

    fn open(&mut self) -> std::io::Result<()> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.size = file.metadata().map(|m| m.len()).unwrap_or(0);
        self.file = Some(BufWriter::with_capacity(64 * 1024, file));
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        if let Some(mut file) = self.file.take() {
            file.flush()?;
        }
        if self.max_files == 1 {
            File::create(&self.path)?;
        } else {
            let numbered = |n: u32| rotated_path(&self.path, n);
            remove_if_present(&numbered(self.max_files - 1))?;
            for n in (1..self.max_files - 1).rev() {
                rename_if_present(&numbered(n), &numbered(n + 1))?;
            }
            rename_if_present(&self.path, &numbered(1))?;
        }
        self.open()
    }
}

/// `<path>.<n>`: the n-th most recent rotated file.
pub fn rotated_path(path: &Path, n: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn rename_if_present(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Counters the writer updates.
pub struct WriterMetrics {
    pub written: IntCounter,
    pub dropped: IntCounterVec,
    /// The queue's bytes, given back as each exchange is written.
    pub queued_bytes: Arc<AtomicUsize>,
}

/// The thread's loop: one blocking receive, then whatever else is queued, then one flush. Ends
/// when every sender is gone or on `Message::Close` (answered once everything before it is
/// written).
pub fn run(config: RecordConfig, queue: Receiver<Message>, metrics: WriterMetrics) {
    let mut file = RotatingFile::new(config.path.trim(), config.max_bytes, config.max_files);
    let mut warned = false;
    // Lines written since the last flush: counted written once they are in the file.
    let mut pending: u64 = 0;
    let mut write = |exchange: &super::Exchange, file: &mut RotatingFile, pending: &mut u64| {
        let line = exchange.to_line(&config.redact_headers);
        match file.write_line(&line) {
            Ok(()) => *pending += 1,
            Err(e) => {
                metrics
                    .dropped
                    .with_label_values(&[RecordDrop::WriteError.as_str()])
                    .inc();
                if !warned {
                    tracing::warn!(path = %config.path, error = %e, "cannot write the recording");
                    warned = true;
                }
            }
        }
    };
    while let Ok(message) = queue.recv() {
        let mut next = Some(message);
        while let Some(message) = next.take() {
            match message {
                Message::Exchange(exchange, bytes) => {
                    write(&exchange, &mut file, &mut pending);
                    drop(exchange);
                    metrics.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
                }
                Message::Close(done) => {
                    let _ = flushed(file.flush(), &mut pending, &metrics);
                    let _ = done.send(());
                    return;
                }
            }
            next = queue.try_recv().ok();
        }
        if let Err(e) = flushed(file.flush(), &mut pending, &metrics) {
            tracing::warn!(path = %config.path, error = %e, "cannot flush the recording");
        }
    }
    let _ = flushed(file.flush(), &mut pending, &metrics);
}

/// Counts the lines `pending` since the last flush as written, or as dropped when the flush
/// failed; passes the flush's result on.
fn flushed(
    flush: std::io::Result<()>,
    pending: &mut u64,
    metrics: &WriterMetrics,
) -> std::io::Result<()> {
    match &flush {
        Ok(()) => metrics.written.inc_by(*pending),
        Err(_) => metrics
            .dropped
            .with_label_values(&[RecordDrop::WriteError.as_str()])
            .inc_by(*pending),
    }
    *pending = 0;
    flush
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_rotate_by_size_and_the_oldest_is_deleted() {
        let dir = std::env::temp_dir().join(format!("ctxproxy-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rec.jsonl");
        let mut file = RotatingFile::new(&path, 25, 3);
        for n in 0..7 {
            file.write_line(format!("{{\"n\":{n}}}\n").as_bytes())
                .unwrap(); // 8 bytes
        }
        file.flush().unwrap();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        // 3 lines fit in 25 bytes: [0,1,2] [3,4,5] [6]; 3 files kept.
        assert_eq!(read(&path), "{\"n\":6}\n");
        assert_eq!(
            read(&rotated_path(&path, 1)),
            "{\"n\":3}\n{\"n\":4}\n{\"n\":5}\n"
        );
        assert_eq!(
            read(&rotated_path(&path, 2)),
            "{\"n\":0}\n{\"n\":1}\n{\"n\":2}\n"
        );
        assert!(!rotated_path(&path, 3).exists());
        for n in 7..10 {
            file.write_line(format!("{{\"n\":{n}}}\n").as_bytes())
                .unwrap();
        }
        file.flush().unwrap();
        assert!(read(&rotated_path(&path, 2)).starts_with("{\"n\":3}"));
        assert!(!rotated_path(&path, 3).exists());

        // One file only: it starts over.
        let single = dir.join("single.jsonl");
        let mut file = RotatingFile::new(&single, 10, 1);
        for n in 0..3 {
            file.write_line(format!("{{\"n\":{n}}}\n").as_bytes())
                .unwrap();
        }
        file.flush().unwrap();
        assert_eq!(read(&single), "{\"n\":2}\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
