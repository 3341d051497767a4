//! The BPE vocabularies (o200k_base, cl100k_base), embedded in the binary and decoded on first
//! use. Their serialized form is 32 and 15 MB. Decoding it from the embedded bytes would page
//! them in, and they would stay counted in the process's memory (RSS) for its whole life,
//! beside the decoded vocabulary. So the same bytes are decoded as they are read from the
//! binary's file instead (`/proc/self/exe`, at the offset where they are mapped), through a
//! small buffer, and checked against the hash the build wrote. Where that cannot be done (no
//! `/proc`), or the bytes read differ, the embedded bytes are decoded as they are.

use std::fs::File;
use std::hash::{DefaultHasher, Hasher};
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::sync::LazyLock;

use bpe::byte_pair_encoding::BytePairEncoding;

use super::Encoding;

/// An embedded vocabulary and the hash of its bytes, as `build.rs` wrote them.
struct Embedded {
    bytes: &'static [u8],
    hash: u64,
}

static O200K_BASE: Embedded = Embedded {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_base.dict")),
    hash: include!(concat!(env!("OUT_DIR"), "/o200k_base.hash")),
};

static CL100K_BASE: Embedded = Embedded {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_base.dict")),
    hash: include!(concat!(env!("OUT_DIR"), "/cl100k_base.hash")),
};

static O200K: LazyLock<BytePairEncoding> = LazyLock::new(|| decode(&O200K_BASE));
static CL100K: LazyLock<BytePairEncoding> = LazyLock::new(|| decode(&CL100K_BASE));

/// The vocabulary of `encoding`, decoded on first use.
pub fn of(encoding: Encoding) -> &'static BytePairEncoding {
    match encoding {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
    }
}

fn decode(embedded: &Embedded) -> BytePairEncoding {
    decode_from_executable(embedded).unwrap_or_else(|| {
        // The build wrote these bytes from a decoded vocabulary: they decode.
        rmp_serde::from_slice(embedded.bytes)
            .unwrap_or_else(|e| unreachable!("an embedded vocabulary does not decode: {e}"))
    })
}

/// `embedded` decoded from the executable's file, not from its mapped pages; `None` when the
/// file cannot be read there, or its bytes are not the embedded ones.
fn decode_from_executable(embedded: &Embedded) -> Option<BytePairEncoding> {
    let mut read = HashingReader::new(executable_copy(embedded.bytes)?);
    let decoded = rmp_serde::from_read(&mut read).ok()?;
    (read.read == embedded.bytes.len() && read.hasher.finish() == embedded.hash).then_some(decoded)
}

/// A reader of `embedded`'s bytes in the executable's file.
fn executable_copy(embedded: &'static [u8]) -> Option<impl Read> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let offset = file_offset(&maps, embedded.as_ptr() as usize)?;
    let mut file = File::open("/proc/self/exe").ok()?;
    file.seek(SeekFrom::Start(offset)).ok()?;
    Some(BufReader::with_capacity(
        64 * 1024,
        file.take(embedded.len() as u64),
    ))
}

/// A reader that hashes and counts what it reads.
struct HashingReader<R> {
    inner: R,
    hasher: DefaultHasher,
    read: usize,
}

impl<R: Read> HashingReader<R> {
    fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: DefaultHasher::new(),
            read: 0,
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.write(&buf[..n]);
        self.read += n;
        Ok(n)
    }
}

/// Where the byte at `address` comes from in the file mapped there, per `/proc/self/maps`
/// (`start-end perms offset dev inode path`).
fn file_offset(maps: &str, address: usize) -> Option<u64> {
    maps.lines().find_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&address) {
            return None;
        }
        let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
        let inode = fields.nth(1)?;
        // An anonymous mapping holds no file's bytes.
        (inode != "0").then_some(offset + (address - start) as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(bytes: &[u8]) -> u64 {
        let mut hasher = DefaultHasher::new();
        hasher.write(bytes);
        hasher.finish()
    }

    #[test]
    fn the_bytes_read_from_the_file_are_the_embedded_ones() {
        for embedded in [&O200K_BASE, &CL100K_BASE] {
            let mut read = Vec::new();
            executable_copy(embedded.bytes)
                .expect("this test runs on Linux")
                .read_to_end(&mut read)
                .unwrap();
            assert_eq!(hash(&read), embedded.hash);
            assert!(read == embedded.bytes);
            assert!(decode_from_executable(embedded).is_some());
        }
    }

    #[test]
    fn bytes_that_differ_from_the_embedded_ones_are_not_taken() {
        let altered = Embedded {
            bytes: CL100K_BASE.bytes,
            hash: CL100K_BASE.hash ^ 1,
        };
        assert!(decode_from_executable(&altered).is_none());
        let mut reader = HashingReader::new(&b"abc"[..]);
        reader.read_to_end(&mut Vec::new()).unwrap();
        assert_eq!((reader.read, reader.hasher.finish()), (3, hash(b"abc")));
    }

    #[test]
    fn an_address_is_found_in_its_mapping() {
        let maps = "55d0c9a00000-55d0c9a29000 r--p 00000000 08:01 1234 /bin/ctxproxy\n\
            55d0c9a29000-55d0c9b00000 r-xp 00029000 08:01 1234 /bin/ctxproxy\n\
            7f0000000000-7f0000001000 rw-p 00000000 00:00 0\n";
        assert_eq!(file_offset(maps, 0x55d0c9a00010), Some(0x10));
        assert_eq!(file_offset(maps, 0x55d0c9a29100), Some(0x29100));
        assert_eq!(file_offset(maps, 0x7f0000000010), None, "anonymous");
        assert_eq!(file_offset(maps, 0x1000), None, "not mapped");
    }

    #[test]
    fn the_decoded_vocabularies_are_the_tokenizer_crates() {
        let text = "Résumé: ünïcödé 🚀 and ASCII, 12345 tokens.\n\n  indented   ";
        assert_eq!(
            of(Encoding::O200kBase).encode_via_backtracking(text.as_bytes()),
            bpe_openai::o200k_base()
                .bpe
                .encode_via_backtracking(text.as_bytes())
        );
        assert_eq!(
            of(Encoding::Cl100kBase).count(text.as_bytes()),
            bpe_openai::cl100k_base().bpe.count(text.as_bytes())
        );
    }
}
