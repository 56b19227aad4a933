"""The built-in prompt set for acceptance measurement, grouped by kind: the categories of the
`builtin` workload (pipeline/speculation/workload.py), which are the acceptance slices.

Acceptance differs by task, so the kinds span open generation (chat, code, long_context,
structured) and input-grounded tasks (summarize, extract, code_edit, doc_qa) whose answers reuse
the prompt, where prompt lookup pays (docs/methods/workloads.md).

The ids are f"{kind}-{i}" by position, and artifacts and tests name them: the first four kinds and
their prompts must not change or reorder; new kinds go after them, new prompts at the end of a kind.
Passages are 80-250 words, code 10-30 lines; everything here was written for this project.
"""
from __future__ import annotations

KINDS = ("chat", "code", "long_context", "structured", "summarize", "extract", "code_edit", "doc_qa")

_REPORT = (
    "Quarterly operations summary. The Lisbon warehouse shipped 4,210 orders in March, up from 3,870 "
    "in February. Average packing time fell to 6.2 minutes after the new conveyor was installed on "
    "March 9. Two incidents were logged: a forklift battery failure on March 14 (no injuries) and a "
    "mislabelled pallet of ceramic tiles on March 22, which was returned to the supplier, Azulejos "
    "Norte. The night shift, led by Marta Ferreira, handled 38% of all orders. Customer complaints "
    "dropped from 57 to 41; most remaining complaints concern delivery windows in the Algarve region. "
    "The team proposes hiring two more drivers for the southern routes and moving the weekly "
    "inventory count from Friday to Monday morning, when the loading bays are quiet. "
)
_STORY = (
    "The lighthouse keeper, Ansel, kept three logbooks. The blue one recorded the weather every "
    "four hours; the red one listed every ship that passed, with its flag and heading; the green "
    "one, which he showed no one, held the names of the birds that rested on the gallery rail. In "
    "the winter of the great storm the red book filled up first, because forty-one fishing boats "
    "sheltered in the bay for nine days. On the tenth day the storm broke, the boats left in a "
    "single line, and Ansel wrote in the green book that a grey heron had stood on the rail all "
    "morning, facing the sea, as if counting them out. "
)

# The code_edit kind's code, as a user would paste it.
_CODE_MEAN = '''def avg(lst):
    total = 0
    count = 0
    for x in lst:
        if x is None:
            continue
        total += x
        count += 1
    if count == 0:
        return 0.0
    return total / count
'''
_CODE_SEARCH = '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    low = 0
    high = len(items)
    while low < high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        elif items[mid] < target:
            low = mid
        else:
            high = mid
    return -1
'''
_CODE_FETCH = '''import time
import urllib.request


def fetch(url, retries=3):
    last_error = None
    for attempt in range(retries):
        try:
            with urllib.request.urlopen(url) as response:
                return response.read().decode("utf-8")
        except OSError as error:
            last_error = error
            time.sleep(2 ** attempt)
    raise RuntimeError(f"could not fetch {url}") from last_error
'''
_CODE_LOAD_USER = '''function loadUser(id, callback) {
  fetch(`/api/users/${id}`)
    .then((response) => {
      if (!response.ok) {
        throw new Error(`HTTP ${response.status}`);
      }
      return response.json();
    })
    .then((user) => {
      return fetch(`/api/teams/${user.teamId}`)
        .then((response) => response.json())
        .then((team) => callback(null, { ...user, team }));
    })
    .catch((error) => callback(error));
}
'''
_CODE_INVENTORY = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name, quantity):
        if self.items.get(name, 0) < quantity:
            raise ValueError(f"not enough {name}")
        self.items[name] -= quantity
        if self.items[name] == 0:
            del self.items[name]

    def count(self, name):
        return self.items.get(name, 0)

    def names(self):
        return sorted(self.items)
'''
_CODE_TAGS = '''def add_tag(tag, tags=[]):
    if tag not in tags:
        tags.append(tag)
    return tags


def tag_posts(posts):
    result = {}
    for post in posts:
        for word in post["title"].split():
            if word.startswith("#"):
                result[post["id"]] = add_tag(word[1:].lower())
    return result
'''
_CODE_POINT = '''import math


class Point:
    def __init__(self, x, y, label=""):
        self.x = x
        self.y = y
        self.label = label

    def __repr__(self):
        return f"Point(x={self.x}, y={self.y}, label={self.label!r})"

    def __eq__(self, other):
        if not isinstance(other, Point):
            return NotImplemented
        return (self.x, self.y, self.label) == (other.x, other.y, other.label)

    def distance_to(self, other):
        return math.hypot(self.x - other.x, self.y - other.y)
'''
_CODE_REPORT = '''def report(name, sales, target):
    lines = []
    lines.append("Sales report for %s" % name)
    lines.append("=" * 30)
    total = 0
    for month, amount in sales:
        lines.append("%-10s %8.2f" % (month, amount))
        total += amount
    lines.append("Total: %.2f" % total)
    if total >= target:
        lines.append("Target of %.2f reached (+%.2f)" % (target, total - target))
    else:
        lines.append("Target of %.2f missed by %.2f" % (target, target - total))
    return "\\n".join(lines)
'''

PROMPTS: dict[str, list[str]] = {
    "chat": [
        "What are three simple ways to save energy at home?",
        "Explain in two sentences why the sky is blue.",
        "I have a job interview tomorrow. Can you give me some advice?",
        "Write a short, friendly message inviting a neighbour to dinner.",
        "What is the difference between weather and climate?",
        "Suggest a name for a small bakery and explain your choice.",
        "How do I keep a basil plant alive indoors?",
        "Summarize the plot of a heist movie in three sentences.",
    ],
    "code": [
        "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a Python class `Stack` with push, pop and peek methods.",
        "Write a SQL query that returns the five customers with the highest total order value "
        "from tables customers(id, name) and orders(id, customer_id, amount).",
        "Write a Python function that counts how often each word occurs in a text.",
        "Write a bash one-liner that counts the lines of every .py file in a directory.",
        "Write a Python function `merge_sorted(a, b)` that merges two sorted lists.",
    ],
    "long_context": [
        _REPORT + "\n\nQuestion: How many orders did the Lisbon warehouse ship in March, and who led "
        "the night shift?",
        _STORY + "\n\nQuestion: What did each of Ansel's three logbooks record?",
        _REPORT + _STORY + "\n\nQuestion: On which date was the conveyor installed?",
        _STORY + _REPORT + "\n\nQuestion: How many fishing boats sheltered in the bay, and for how long?",
        _REPORT + "\n\nRewrite the summary above as a bulleted list of the key numbers.",
        _STORY + "\n\nRetell the story above in three sentences.",
    ],
    "structured": [
        "Return a JSON object with keys name, age and city for a fictional person. Output only JSON.",
        "Call the weather tool for Paris in celsius. Reply with a JSON object "
        "{\"name\": ..., \"arguments\": {...}} and nothing else.",
        "List three fruits as a JSON array of objects with keys \"fruit\" and \"colour\".",
        "Write a YAML config with a server section (host, port) and a database section (url, pool_size).",
        "Produce a CSV table with header id,product,price and three rows of example data.",
        "Call the tool `search_flights` with origin LIS, destination BER and date 2024-05-01. Answer "
        "with the JSON call only.",
        "Convert this to JSON: name Ana, languages Portuguese and English, employed yes.",
        "Return a JSON list of the first five prime numbers under the key \"primes\".",
    ],
    "summarize": [
        "Summarize the following passage in two or three sentences.\n\n"
        "At its meeting on 12 June, the Harrowgate town council voted 7 to 2 to build a protected cycle lane along "
        "Mill Road, the main route between the railway station and the secondary school. The lane will run for 1.8 "
        "kilometres and be separated from traffic by a low concrete kerb. Construction is expected to cost 640,000 "
        "pounds, of which 400,000 comes from a regional transport grant and the rest from the council's road "
        "maintenance budget. Work will begin in September and last about ten weeks; during that time Mill Road "
        "will be one-way northbound. Councillor Priya Nandakumar, who proposed the scheme, said that cycle counts "
        "on the road had doubled since 2019. The two councillors who voted against it argued that the loss of 46 "
        "parking spaces would hurt shops near the station.",
        "Write a short summary of this study for a general audience, keeping the key numbers.\n\n"
        "In a study of 84 adult volunteers, researchers at the Institute for Cognitive Health tested whether a "
        "short afternoon nap improves recall of newly learned material. Participants studied a list of 60 word "
        "pairs at 1 p.m. Half of them then slept for 30 minutes in a quiet room, while the other half watched a "
        "nature documentary for the same period. At 5 p.m. both groups were asked to recall the second word of "
        "each pair. The nap group recalled on average 41 pairs and the documentary group 35. The advantage was "
        "largest for pairs that had been studied only once. Participants who slept longer than 20 minutes showed "
        "no extra benefit over those who slept between 10 and 20 minutes. The authors caution that all volunteers "
        "were between 20 and 35 years old and that the effect may differ in older adults.",
        "Summarize this recall notice as three bullet points that a customer needs to know.\n\n"
        "Brightwell Appliances is recalling about 12,500 electric kettles sold under the model name Aurora 1.7L "
        "between January and April of this year. The base of the kettle can overheat when the kettle is switched "
        "on without water, and in rare cases the plastic housing may melt. The company has received 23 reports of "
        "overheating, including two reports of minor burns. No fires have been reported. The affected kettles have "
        "a silver handle and a batch code starting with AK24 printed under the base. Customers should stop using "
        "the kettle immediately, unplug it and contact Brightwell for a free replacement or a full refund. Kettles "
        "with a black handle, and all other Brightwell models, are not affected. Retailers have been asked to "
        "remove the remaining stock from their shelves.",
        "The Elsmere Canal was dug between 1794 and 1801 to carry coal from the pits at Carrow Hill to the river "
        "port of Danby, a distance of 31 miles. Before the canal, coal travelled by packhorse and cost almost "
        "three times as much at Danby as at the pits. The engineer, Josiah Penhale, avoided an expensive tunnel by "
        "taking the canal around the western side of Carrow Hill, which added four miles but saved, by his "
        "estimate, two years of work. Twenty-two locks lifted boats a total of 190 feet. At its busiest, in the "
        "1830s, the canal carried 300,000 tons of cargo a year. Railway competition reduced that figure by half "
        "within twenty years, and commercial traffic ended in 1938. Today volunteers maintain the towpath, and the "
        "locks are used by pleasure boats."
        "\n\n"
        "Summarize the passage above in one paragraph.",
        "Give me a TL;DR of this email in two sentences.\n\n"
        "Hi all, a quick update on the release of version 3.2 of the booking app. We planned to ship on 4 March, "
        "but we are moving the date to 18 March. The main reason is the payment provider's new API: their sandbox "
        "was down for most of last week, so we could not finish testing refunds. Two smaller issues also need "
        "fixing first: the calendar view is slow for users with more than 500 bookings, and push notifications "
        "arrive twice on some Android phones. Tomás is working on the calendar performance and expects a fix by "
        "Friday. Leila has a patch for the notifications that is in review. Customer support has been told about "
        "the new date, and the marketing email planned for 5 March will be rescheduled. Please keep new features "
        "out of the 3.2 branch until the release is out. Thanks, Grace",
        "Summarize this hotel review as a list of the good points and a list of the bad points.\n\n"
        "We stayed four nights at the Hotel Miramar in late October. The location is excellent: the beach is two "
        "minutes away and the old town about fifteen minutes on foot. Our room on the third floor had a small "
        "balcony with a sea view, and it was cleaned every day. The bed was comfortable, but the air conditioning "
        "was noisy and we had to switch it off at night. Breakfast was the highlight, with fresh fruit, local "
        "cheeses and eggs cooked to order, although the dining room got crowded after nine. The staff at reception "
        "were friendly and booked a boat trip for us, but the front desk closes at midnight, which was "
        "inconvenient when we came back late one evening. Parking costs 18 euros a day and must be reserved in "
        "advance. Overall we would come back, but we would ask for a room at the back, away from the street.",
        "Summarize the article below in one paragraph of no more than 60 words.\n\n"
        "The Central Library on Queen Street reopened on Saturday after an eighteen-month renovation. The "
        "building, which dates from 1912, now has a lift to every floor, a new roof and solar panels that are "
        "expected to cover a third of its electricity use. The ground floor has been turned into an open "
        "children's area with a small stage for story time, and the old reading room on the first floor has been "
        "restored with its original oak shelves. A new study space on the second floor offers 80 desks with power "
        "sockets, bookable online for up to four hours. Opening hours have been extended: the library now opens at "
        "8 a.m. on weekdays and stays open until 8 p.m. on Thursdays. The renovation cost 9.4 million dollars, "
        "slightly over the original budget of 8.7 million, mainly because of damp found in the basement walls.",
        "Mangrove forests grow along tropical and subtropical coasts, where they are flooded by the tide twice a "
        "day. Their roots cope with salt water and with mud that holds very little oxygen: some species push up "
        "pencil-like roots that take in air at low tide, while others stand on arching stilt roots. Mangroves "
        "protect the shore by slowing waves and trapping sediment, and during storms a wide belt of mangroves can "
        "reduce flooding in the villages behind it. They also shelter young fish, crabs and shrimp, many of which "
        "are later caught far offshore. Mangrove soils store large amounts of carbon, often more per hectare than "
        "inland tropical forests. Despite this, a large share of the world's mangroves has been cleared since the "
        "1980s, mostly for shrimp farms, rice fields and coastal building."
        "\n\n"
        "Summarize the text above in three sentences, using its own wording where you can.",
    ],
    "extract": [
        "Extract the following fields from the job posting below and return them as a JSON object: job_title, "
        "company, city, work_mode, salary_min, salary_max, currency, application_email, deadline. Output only "
        "JSON.\n\n"
        "Northwind Analytics is hiring a Senior Data Engineer to join its platform team in Rotterdam. The role is "
        "hybrid, with three days a week in the office on Wilhelminakade. You will design and maintain the "
        "pipelines that load sensor data from our customers' wind farms into our warehouse, currently about 2 "
        "terabytes a day. We are looking for at least five years of experience with Python and SQL, and "
        "familiarity with Apache Spark or a similar engine. Experience with Dutch or German is a plus but not "
        "required. The salary range is 72,000 to 88,000 euros a year, plus a 10% bonus and 28 days of paid leave. "
        "To apply, send your CV to careers@northwind-analytics.example before 30 September. Interviews will take "
        "place in the first two weeks of October.",
        "From the email below, extract the meeting date, time, room and the list of attendees (including anyone "
        "joining remotely). Reply with a JSON object with the keys date, time, room and attendees.\n\n"
        "Subject: Planning meeting moved\n\n"
        "Hello everyone,\n\n"
        "The quarterly planning meeting has moved from Tuesday to Wednesday 14 May, still at 10:30. We will meet "
        "in room B-204 on the second floor instead of the large conference room, which is being painted. "
        "Attending: Hannah Okafor (chair), Daniel Weiss, Mei Lin Chou, Rafael Souza and Ingrid Halvorsen. Olu "
        "Adeyemi will join by video from the Lagos office. Please read the draft budget before the meeting; it is "
        "in the shared folder under Finance/Q3. Lunch will be provided, so let Daniel know by Monday if you have "
        "dietary requirements.\n\n"
        "Best,\nHannah",
        "INVOICE No. 2024-0417\nIssued: 3 April 2024\nFrom: Greenleaf Office Supplies, 14 Harbour Lane, Cork\nTo: "
        "Atlas Design Studio, 2 Fitzwilliam Street, Dublin\n\n"
        "10 x A4 paper, 500 sheets, at 4.50 each: 45.00\n3 x Black toner cartridge TN-2420 at 61.00 each: 183.00\n"
        "2 x Desk organiser, bamboo, at 18.75 each: 37.50\n1 x Whiteboard 120x90 cm at 94.00: 94.00\n\n"
        "Subtotal: 359.50\nVAT 23%: 82.69\nTotal due: 442.19 EUR\nPayment within 30 days by bank transfer to IBAN "
        "IE29 AIBK 9311 5212 3456 78, quoting the invoice number."
        "\n\n"
        "Extract the invoice number, issue date, seller, buyer, every line item (description, quantity, "
        "unit_price) and the total due into JSON. Output only the JSON.",
        "Extract these fields from the listing as JSON: address, city, bedrooms, area_m2, floor, rent_eur, "
        "charges_eur, deposit_eur, available_from, parking, pets_allowed, lift.\n\n"
        "For rent: bright two-bedroom apartment on the fourth floor of a 1960s building at 27 Rue des Tanneurs, "
        "Lyon. 68 square metres, with a living room facing south, a separate kitchen, one bathroom with a shower "
        "and a small balcony. The flat was repainted last year and has new double-glazed windows. Heating is "
        "collective and included in the charges. There is a lift and a cellar storage room; no parking. Rent is "
        "1,050 euros per month plus 120 euros of charges, and the deposit is one month's rent. Available from 1 "
        "November. Pets are allowed on request. The nearest metro station, Hôtel de Ville, is five minutes away. "
        "Contact the agency Immo Saône on 04 72 00 00 00 to arrange a visit.",
        "Pull the following out of this reminder as a list, one 'field: value' per line: pet name, species and "
        "breed, age, owner, date, time, vet, reason for the visit, things to bring, phone number for "
        "cancellations.\n\n"
        "Reminder from Riverside Veterinary Clinic: Bella, a six-year-old Labrador retriever owned by Mr. Kenji "
        "Watanabe, is booked for her annual check-up and rabies booster on Friday 9 August at 3:15 p.m. with Dr. "
        "Amelia Brooks. Please bring Bella's vaccination booklet and a fresh stool sample in a sealed container. "
        "Bella should not be fed for six hours before the appointment, because the vet may take a blood sample to "
        "check her kidney values, as discussed at her last visit in February. If you need to cancel, please call "
        "555-0142 at least 24 hours in advance; late cancellations are charged a fee of 25 dollars. The clinic is "
        "at 88 Riverside Drive, and there is free parking behind the building.",
        "Join us for the Harbourfront Jazz Night on Saturday 21 June, from 7 p.m. to 11 p.m., at the old customs "
        "warehouse, Pier 4, Halifax. This year's line-up features the Marguerite Doucet Quartet, the student big "
        "band of Dalhousie Street College and a late set by the trumpeter Elijah Moreau. Tickets cost 35 dollars "
        "in advance and 45 at the door; students with ID pay 20. Food trucks will be on site and the bar accepts "
        "cards only. The warehouse is wheelchair accessible, and doors open at 6:30 p.m. For group bookings of ten "
        "or more, email events@harbourfront.example or call 902-555-0199. All proceeds go to the city's music "
        "education fund."
        "\n\n"
        "Extract the event name, date, start and end time, venue, performers, ticket prices (advance, door, "
        "student), contact email and phone from the announcement above. Return a JSON object.",
        "Extract the order number, carrier, tracking number, ship date, estimated delivery date and time window, "
        "delivery address, and the items (name, quantity, size) from this message. Output JSON only.\n\n"
        "Your order #A-58213 has shipped! Hi Sofia, good news: the parcel with your order left our warehouse in "
        "Leipzig on 12 March. It is being delivered by DHL Express with tracking number 1Z 894 221 0053. Estimated "
        "delivery: Thursday 14 March between 9:00 and 13:00. The parcel contains: 1 x Trail running shoes, "
        "women's, size 39, colour slate blue; 2 x Merino running socks, size M. The parcel weighs 1.4 kg. Delivery "
        "address: Sofia Marques, Kastanienallee 45, 10435 Berlin. If you are not at home, the driver will leave "
        "the parcel at the Packstation on Schönhauser Allee. Returns are free within 30 days.",
        "Read the lease below and return a JSON object with: landlord, tenants (a list), property_address, "
        "start_date, end_date, monthly_rent, deposit, tenant_pays (a list), landlord_pays (a list), "
        "notice_period.\n\n"
        "This lease agreement is made on 1 February 2025 between Margaret Ellison (the Landlord) and Kwame Mensah "
        "and Laura Petrescu (the Tenants) for the property at Flat 3, 19 Cedar Grove, Leeds LS6 2AB. The term is "
        "twelve months, starting on 1 March 2025 and ending on 28 February 2026. The monthly rent is 1,150 pounds, "
        "payable on the first day of each month by bank transfer. A deposit of 1,325 pounds will be held in a "
        "government-approved deposit scheme. The Tenants are responsible for electricity, gas, water and council "
        "tax; the Landlord pays for building insurance and for the annual gas safety check. Smoking is not "
        "permitted in the property. Either party may end the agreement after six months by giving two months' "
        "notice in writing.",
    ],
    "code_edit": [
        "Rename the function `avg` to `mean_price`, its parameter `lst` to `prices` and the loop variable `x` "
        "to `price`. Return the whole function with nothing else changed.\n\n```python\n" + _CODE_MEAN + "```",
        "This function sometimes never returns. Find the bug and return the corrected function in full.\n\n"
        "```python\n" + _CODE_SEARCH + "```",
        "Add a `timeout` parameter (in seconds, default 10) to `fetch` and pass it on to `urlopen`. Show the "
        "complete updated code.\n\n```python\n" + _CODE_FETCH + "```",
        "Rewrite this JavaScript function with async/await so that it returns a promise instead of taking a "
        "callback. Keep the same URLs and error message.\n\n```javascript\n" + _CODE_LOAD_USER + "```",
        "```python\n" + _CODE_INVENTORY + "```\n\nAdd type hints to every method of the class above and a one-line "
        "docstring to each method. Return the full class.",
        "In this code every post ends up with the tags of all the posts. Explain the bug in one sentence, then "
        "give the fixed code in full.\n\n```python\n" + _CODE_TAGS + "```",
        "```python\n" + _CODE_POINT + "```\n\nConvert this class to a dataclass, keeping `distance_to` as it is.",
        "Replace every %-format in this function with an f-string that gives the same output. Return the whole "
        "function.\n\n```python\n" + _CODE_REPORT + "```",
    ],
    "doc_qa": [
        "Fairway Fitness membership terms (summary). Memberships run month to month and renew automatically on the "
        "day of the month you joined. You may cancel at any time by giving 30 days' notice at the front desk or "
        "through the app; cancellations by email are not accepted. Members can freeze their membership once per "
        "calendar year for between two weeks and three months; a frozen membership costs 5 pounds a month. Each "
        "member may bring one guest up to four times a year; the guest must be over 16 and show photo ID. Classes "
        "can be booked up to seven days ahead, and a missed class without 12 hours' notice counts as attended. "
        "Lockers are free during your visit, but anything left overnight will be removed."
        "\n\n"
        "Using only the terms above: can I freeze my membership, for how long, and what does it cost?",
        "## Development setup\n\n"
        "This project needs Python 3.10 or newer. Clone the repository and create a virtual environment in the "
        "project folder:\n\n"
        "    python -m venv .venv\n    source .venv/bin/activate\n\n"
        "Install the package together with the development tools (pytest, ruff and mypy):\n\n"
        "    pip install -e \".[dev]\"\n\n"
        "Run the fast tests with `pytest -m 'not slow'`; the full suite, including the slow integration tests, "
        "runs with plain `pytest` and needs Docker, because it starts a temporary PostgreSQL container. Before "
        "opening a pull request, run `ruff check .` and `mypy src`. The documentation is built with `mkdocs serve` "
        "from the `docs` folder and is published automatically when a release tag is pushed."
        "\n\n"
        "According to this README, which command installs the development tools, and what do the slow tests need?",
        "Answer from the notice below only.\n\n"
        "Service changes on the Valley Line, 3 to 16 November. Because of track renewal between Ashford Mill and "
        "Kettering Cross, trains will not run between those two stations after 9 p.m. from Monday to Thursday. "
        "Replacement buses will leave from the station forecourt at Ashford Mill and take about 35 minutes to "
        "Kettering Cross; bicycles cannot be carried on the buses. On Fridays and at weekends trains run as "
        "normal, except on Sunday 9 November, when the first train from Ashford Mill will leave at 10:12 instead "
        "of 7:40. The last direct train from Ashford Mill to Kettering Cross on weekdays leaves at 8:47 p.m. "
        "Season tickets are valid on the replacement buses. For live updates, check the Valley Line app."
        "\n\n"
        "Question: I need to travel from Ashford Mill to Kettering Cross on Tuesday 4 November at 10 p.m. with my "
        "bicycle. What are my options?",
        "Travel expenses policy, section 4: meals and accommodation. Employees travelling on company business are "
        "reimbursed for meals up to a daily allowance: 45 euros for trips within the country and 70 euros for "
        "trips abroad. Alcohol is not reimbursed. On days of travel that start after 2 p.m. or end before 11 a.m., "
        "half the daily allowance applies. Hotels must be booked through the company travel portal; the nightly "
        "limit is 130 euros, or 190 euros in cities on the high-cost list (currently London, Zurich, New York and "
        "Tokyo). Stays with friends or family are eligible for a flat 30 euros per night instead. Receipts must be "
        "uploaded within 30 days of return, or the claim may be rejected."
        "\n\n"
        "What is my meal allowance for a day abroad on which my flight leaves at 4 p.m.? Quote the sentences of "
        "the policy you rely on.",
        "Visitor information. The Maritime Museum is open from Tuesday to Sunday, 10 a.m. to 5 p.m., and until 9 "
        "p.m. on the first Friday of every month. It is closed on Mondays, except on public holidays, and on 25 "
        "December. Admission is 14 dollars for adults and 9 dollars for seniors over 65 and for students. Children "
        "under 12 enter free with a paying adult, up to three children per adult. The restored steamship "
        "Albatross, moored outside, can be visited only on a guided tour, which runs every hour from 11 a.m. and "
        "costs 6 dollars extra; the ship has steep ladders and is not suitable for children under 5. Large bags "
        "must be left in the free lockers in the entrance hall. Photography is allowed without flash."
        "\n\n"
        "Question: Two adults with children aged 3, 7 and 10 want to see the museum and the Albatross. How much "
        "will they pay, and is there anything they should know?",
        "Answer the question from the warranty text and cite the sentence that decides it.\n\n"
        "Limited warranty. Solano e-bikes are covered against defects in materials and workmanship for two years "
        "from the date of purchase. The frame is covered for five years. The battery is covered for two years or "
        "500 full charge cycles, whichever comes first; a loss of capacity of up to 30% within that period is "
        "considered normal wear. The warranty does not cover damage from accidents, misuse, racing, or "
        "modifications to the motor or controller, nor parts that wear with normal use, such as tyres, brake pads, "
        "chains and grips. Water damage is covered only if the bike was used within its IP54 rating; immersing the "
        "motor or battery in water voids the warranty. To make a claim, contact the dealer where the bike was "
        "bought, with proof of purchase."
        "\n\n"
        "Question: After 18 months my battery holds 75% of its original charge. Is that covered?",
        "Course: Introduction to Statistics (STAT 101), spring term. Lectures are on Mondays and Wednesdays from "
        "9:00 to 10:30 in the Hooke Building, room 1.12. Weekly problem sets are due on Fridays at noon and "
        "together count for 20% of the final grade; the lowest problem set score is dropped. There is a midterm "
        "exam in week 7 worth 25%, a group project worth 15%, and a final exam worth 40%. Students must score at "
        "least 40% on the final exam to pass the course, regardless of their other marks. Late problem sets lose "
        "10% per day and are not accepted after three days. Office hours are on Tuesdays from 14:00 to 16:00, or "
        "by appointment with the lecturer, Dr. Yusuf Demir."
        "\n\n"
        "Question: How is the final grade computed, and is there any condition for passing the course?",
        "House rules for residents of Linden Court. The laundry room in the basement is open from 7 a.m. to 10 "
        "p.m.; each flat may book the machines for up to two slots of three hours per week using the sheet on the "
        "laundry room door. Please remove your laundry promptly and clean the lint filter after using the dryer. "
        "Quiet hours are from 10 p.m. to 7 a.m. on weekdays and from 11 p.m. to 9 a.m. at weekends. Bicycles must "
        "be kept in the bike room, not in the stairwell. Rubbish goes in the bins in the courtyard: paper on "
        "Tuesdays and general waste on Thursdays; glass may be taken to the bottle bank on the corner at any time. "
        "Barbecues are not allowed on balconies. Repairs should be reported to the caretaker, Mr. Novak, on 0161 "
        "555 0134."
        "\n\n"
        "Question: When can I do my laundry, how often per week, and what should I do after using the dryer?",
    ],
}


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a user turn, through the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(text)
