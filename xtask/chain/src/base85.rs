//! git's base85 (the alphabet of `GIT binary patch` data lines).

const ALPHABET: &[u8; 85] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~";

fn value(c: u8) -> Option<u32> {
    ALPHABET.iter().position(|&a| a == c).map(|v| v as u32)
}

/// Decodes one data line: a length character (`A`-`Z` = 1-26, `a`-`z` = 27-52), then base85.
pub fn decode_line(line: &[u8]) -> Result<Vec<u8>, String> {
    let (&len_char, body) = line.split_first().ok_or("empty binary data line")?;
    let len = match len_char {
        b'A'..=b'Z' => (len_char - b'A' + 1) as usize,
        b'a'..=b'z' => (len_char - b'a' + 27) as usize,
        _ => return Err(format!("bad length character {:?}", len_char as char)),
    };
    if body.len() % 5 != 0 || body.len() / 5 * 4 < len {
        return Err(format!("data line of {} characters cannot hold {len} bytes", body.len()));
    }
    let mut out = Vec::with_capacity(body.len() / 5 * 4);
    for chunk in body.chunks(5) {
        let mut acc: u64 = 0;
        for &c in chunk {
            acc = acc * 85 + u64::from(value(c).ok_or_else(|| format!("bad base85 character {:?}", c as char))?);
        }
        if acc > u64::from(u32::MAX) {
            return Err("base85 group overflows 32 bits".into());
        }
        out.extend_from_slice(&(acc as u32).to_be_bytes());
    }
    out.truncate(len);
    Ok(out)
}

/// Encodes `data` as git does: lines of at most 52 bytes.
pub fn encode_lines(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(52) {
        let n = chunk.len();
        out.push(if n <= 26 { (b'A' + n as u8 - 1) as char } else { (b'a' + n as u8 - 27) as char });
        for group in chunk.chunks(4) {
            let mut word = [0u8; 4];
            word[..group.len()].copy_from_slice(group);
            let mut v = u32::from_be_bytes(word);
            let mut enc = [0u8; 5];
            for slot in enc.iter_mut().rev() {
                *slot = ALPHABET[(v % 85) as usize];
                v /= 85;
            }
            out.push_str(std::str::from_utf8(&enc).expect("alphabet is ASCII"));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trips_every_length() {
        for n in 0..120usize {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 % 256) as u8).collect();
            let text = super::encode_lines(&data);
            let back: Vec<u8> = text.lines().flat_map(|l| super::decode_line(l.as_bytes()).expect("valid line")).collect();
            assert_eq!(back, data, "length {n}");
        }
    }
}
