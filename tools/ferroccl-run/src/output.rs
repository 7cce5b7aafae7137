//! The ranks' output: each line of each rank's stdout and stderr, prefixed with its rank.
//! Flight-record lines on stderr (see `ferroccl::flight`) are kept for the verdict and
//! passed on only with `-v`.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

/// Flight-record lines of the ranks, as read (see `ferroccl::flight::parse`).
pub(crate) type FlightLines = Arc<Mutex<Vec<String>>>;

/// Longest line passed on whole; longer ones are split.
const MAX_LINE: usize = 1 << 20;

/// Copies one output stream of one rank to the runner's stream, a line at a time.
pub(crate) fn pump(src: impl Read, rank: usize, to_stderr: bool, prefix: bool, flight: Option<(FlightLines, bool)>) {
    let mut reader = BufReader::with_capacity(64 << 10, src);
    let tag = format!("[{rank}] ");
    let mut line: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let emit = |line: &[u8], out: &mut Vec<u8>| {
        if let Some((lines, show)) = &flight {
            if line.starts_with(ferroccl::flight::PREFIX.as_bytes()) {
                lines.lock().unwrap_or_else(|e| e.into_inner()).push(String::from_utf8_lossy(line).trim_end().to_string());
                if !show {
                    return;
                }
            }
        }
        out.clear();
        if prefix {
            out.extend_from_slice(tag.as_bytes());
            let body = line.strip_suffix(b"\n").unwrap_or(line);
            out.extend_from_slice(String::from_utf8_lossy(body).as_bytes());
            out.push(b'\n');
        } else {
            out.extend_from_slice(line);
        }
        // Errors (a closed stdout) are ignored: the rank's output is still drained, so it
        // never blocks on a full pipe.
        if to_stderr {
            let _ = io::stderr().lock().write_all(out);
        } else {
            let mut so = io::stdout().lock();
            let _ = so.write_all(out).and_then(|()| so.flush());
        }
    };
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        let (take, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete || line.len() >= MAX_LINE {
            emit(&line, &mut out);
            line.clear();
        }
    }
    if !line.is_empty() {
        emit(&line, &mut out);
    }
}
