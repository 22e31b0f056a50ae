//! Text from agents and logs made safe for an operator's terminal. Tool names, inputs,
//! scar reasons and records are written by agents (or by whoever edited a log file);
//! printed raw, escape sequences in them can rewrite the line, retitle the window or set
//! the clipboard, and invisible characters can reorder or hide what an approver reads.

/// `text` with every character that could act on the terminal or hide text shown as a
/// `\u{..}` escape: control characters (C0, DEL and C1, CSI among them), bidi controls,
/// zero-width and other invisible format characters, line and paragraph separators, and
/// tag characters. Everything else, non-ASCII letters included, is kept as it is.
pub fn printable(text: &(impl std::fmt::Display + ?Sized)) -> String {
    let text = text.to_string();
    if !text.chars().any(hidden) {
        return text;
    }
    let mut shown = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if hidden(c) {
            shown.extend(c.escape_unicode());
        } else {
            shown.push(c);
        }
    }
    shown
}

fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'
                | '\u{180e}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{2069}'
                | '\u{feff}'
                | '\u{e0000}'..='\u{e007f}'
        )
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn escape_sequences_and_invisible_characters_are_shown_escaped() {
        let tool = "\u{1b}[2K\u{1b}[1Gread_file";
        assert_eq!(printable(tool), "\\u{1b}[2K\\u{1b}[1Gread_file");
        // Clipboard writes (OSC 52), and newlines that forge extra rows.
        assert!(!printable("\u{1b}]52;c;aGk=\u{7}").contains('\u{1b}'));
        assert_eq!(printable("a\nb"), "a\\u{a}b");
        // DEL and C1's CSI, which canonical JSON leaves raw.
        assert_eq!(printable("\u{7f}\u{9b}2J"), "\\u{7f}\\u{9b}2J");
        // Bidi overrides and isolates, zero-width marks, separators, tags.
        for c in [
            '\u{202e}',
            '\u{2067}',
            '\u{200b}',
            '\u{061c}',
            '\u{2028}',
            '\u{e0041}',
        ] {
            assert_eq!(
                printable(&format!("a{c}b")),
                format!("a{}b", c.escape_unicode())
            );
        }
        // Ordinary text, non-ASCII letters included, is left alone.
        assert_eq!(
            printable("envoyer_courriel é 名前 emoji 🙂"),
            "envoyer_courriel é 名前 emoji 🙂"
        );
    }
}
