//! The commands of a page's ```` ```sh ```` blocks, split into words as a shell would.

/// The commands of a page's ```` ```sh ```` blocks as a shell splits them (quotes, `\` line
/// continuations, comments, `&&`, `||`, `|`, `;`, `&`), each with the line it starts on. The
/// commands inside `$(…)` are returned too.
pub(crate) fn commands(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut block = String::new();
    let (mut inside, mut first) = (false, 0);
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (inside, fence) {
            (false, Some(lang)) if lang.trim() == "sh" => (inside, first) = (true, i + 2),
            (true, Some(_)) => {
                split(&std::mem::take(&mut block), first, &mut out);
                inside = false;
            }
            (true, None) => block.extend([line, "\n"]),
            _ => {}
        }
    }
    out
}

/// Splits `script` (starting at line `first_line` of its page) into commands, appending them to
/// `out`.
fn split(script: &str, first_line: usize, out: &mut Vec<(usize, Vec<String>)>) {
    let chars: Vec<char> = script.chars().collect();
    let (mut line, mut i) = (first_line, 0);
    let (mut words, mut word, mut in_word, mut start) = (Vec::new(), String::new(), false, line);
    fn end_word(words: &mut Vec<String>, word: &mut String, in_word: &mut bool) {
        if std::mem::take(in_word) {
            words.push(std::mem::take(word));
        }
    }
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\\' if chars.get(i + 1) == Some(&'\n') => (i, line) = (i + 1, line + 1),
            '\\' => {
                word.extend(chars.get(i + 1));
                (i, in_word) = (i + 1, true);
            }
            '\'' | '"' => {
                let len = chars[i + 1..]
                    .iter()
                    .position(|&q| q == c)
                    .unwrap_or(chars.len() - i - 1);
                word.extend(&chars[i + 1..i + 1 + len]);
                (i, in_word) = (i + 1 + len, true);
            }
            '$' if chars.get(i + 1) == Some(&'(') => {
                let mut depth = 0;
                let len = chars[i + 1..]
                    .iter()
                    .position(|&p| {
                        depth += i32::from(p == '(') - i32::from(p == ')');
                        depth == 0
                    })
                    .unwrap_or(chars.len() - i - 1);
                let inner: String = chars[i + 2..i + 1 + len].iter().collect();
                split(&inner, line, out);
                word.push_str("$(…)");
                (i, in_word) = (i + 1 + len, true);
            }
            '#' if !in_word => {
                while chars.get(i + 1).is_some_and(|&n| n != '\n') {
                    i += 1;
                }
            }
            ' ' | '\t' => end_word(&mut words, &mut word, &mut in_word),
            '\n' | ';' | '&' | '|' => {
                end_word(&mut words, &mut word, &mut in_word);
                if !words.is_empty() {
                    out.push((start, std::mem::take(&mut words)));
                }
                line += usize::from(c == '\n');
            }
            _ => {
                if !in_word && words.is_empty() {
                    start = line;
                }
                word.push(c);
                in_word = true;
            }
        }
        i += 1;
    }
    end_word(&mut words, &mut word, &mut in_word);
    if !words.is_empty() {
        out.push((start, words));
    }
}
