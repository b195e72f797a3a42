"""The sentences of the pretrained study (docs/bounds.md §1.6), shipped as a constant so that the
study needs no data file. Written for this suite: everyday English of varied length and topic, the
shortest first (a 5-token input, [CLS] and [SEP] included, keeps n·d ≤ DENSE_LIMIT at d = 384, so its
norms are exact SVDs; the longer ones take the probabilistic certificate). A cell names a sentence
by its index here: never reorder or edit, only append."""

SENTENCES: tuple[str, ...] = (
    "Good morning.",
    "It is raining.",
    "The cat sat on the mat.",
    "Please close the door behind you.",
    "She bought fresh bread at the market.",
    "My phone battery died during the meeting.",
    "The train to the airport leaves every twenty minutes.",
    "He forgot his umbrella and got soaked on the way home.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Our team finally fixed the bug that crashed the server last night.",
    "The museum opens at nine, but the queue starts forming much earlier.",
    "A gentle breeze carried the smell of pine through the open window.",
    "If you mix blue and yellow paint, you get a shade of green.",
    "The children built a sandcastle and watched the tide wash it away.",
    "Before submitting the report, double-check every figure in the appendix.",
    "The old lighthouse has guided ships along this rocky coast for two centuries.",
    "Researchers measured how quickly the glacier retreated over the past decade.",
    "After the concert, we walked along the river and talked until midnight.",
    "The recipe calls for two cups of flour, three eggs, and a pinch of salt.",
    "Although the forecast promised sunshine, dark clouds gathered over the hills by noon.",
    "The library extended its opening hours so that students could prepare for exams.",
    "A small bakery on the corner sells the best cinnamon rolls in the whole city.",
    "When the power went out, the neighbours gathered in the street with candles and stories.",
    "The committee postponed its decision because several members were travelling abroad.",
    "Learning a new language takes patience, practice, and a willingness to make mistakes.",
    "The hikers reached the summit just as the sun rose above the distant mountains.",
    "Self-attention lets every token of a sentence look at every other token before the next layer.",
    "The spacecraft sent back detailed images of the icy moon's cracked and shifting surface.",
    "Despite the heavy traffic, the ambulance reached the hospital in less than ten minutes.",
    "On quiet Sunday mornings my grandfather used to read the newspaper aloud to the whole family, "
    "pausing to comment on every story.",
)
