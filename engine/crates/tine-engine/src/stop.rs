//! Stop strings over streamed text.

/// Finds stop strings in generated text and says how much text is safe to hand out.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect() }
    }

    /// The earliest full match at or after `from`: (byte position, the stop string).
    pub fn find(&self, text: &str, from: usize) -> Option<(usize, &str)> {
        let mut best: Option<(usize, &str)> = None;
        for s in &self.stops {
            // Back up so a match straddling `from` is found.
            let mut start = from.saturating_sub(s.len());
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            if let Some(p) = text[start..].find(s.as_str()) {
                let pos = start + p;
                if best.is_none_or(|(b, _)| pos < b) {
                    best = Some((pos, s));
                }
            }
        }
        best
    }

    /// How many bytes of `text` can be handed out: all but a tail that could begin a stop string.
    pub fn safe_len(&self, text: &str) -> usize {
        let mut safe = text.len();
        for s in &self.stops {
            for k in (1..s.len().min(text.len() + 1)).rev() {
                if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    safe = safe.min(text.len() - k);
                    break;
                }
            }
        }
        safe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_a_partial_stop_and_finds_a_split_one() {
        let m = StopMatcher::new(vec!["</end>".into(), "".into()]);
        assert_eq!(m.safe_len("hello </e"), 6);
        assert_eq!(m.safe_len("hello"), 5);
        assert_eq!(m.find("hello </end> more", 8), Some((6, "</end>")));
        assert_eq!(m.find("héllo", 0), None);
    }
}
